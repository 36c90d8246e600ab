"""The engine core process: EngineCore's busy loop behind ZMQ sockets (see server/engine_client.py).

Receives [b"ADD", EngineRequest] / [b"ABORT", list[str]] / [b"STATS"] / [b"WAKE"] frames on a PULL
socket, steps the engine while it has work (blocking on the socket when idle), and pushes
[b"OUT", list[RequestOutput]], [b"STATS", SchedulerStats, dp rank] and [b"REJECT", [id, message,
http_status]] frames back. Dies with its parent.
"""
import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import zmq

from tandem.engine.config import EngineConfig
from tandem.engine.protocol import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_MS = 1000  # idle wake-up period, only to notice a dead parent
# Lockstep DP ranks step together even when idle (an all-reduce each): between idle steps they
# wait this long for input. The API sends every other rank a WAKE with each new request, so a
# new request does not wait for the nap; a stale WAKE only makes a rank step early.
_LOCKSTEP_IDLE_POLL_MS = 50
_STATS_PERIOD_S = 1.0


def die_with_parent(parent_pid: int | None) -> None:
    """Get SIGTERM when the parent dies (Linux prctl), and exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


class EngineCoreLoop:
    """Moves frames between the sockets and an EngineCore."""

    def __init__(self, core, input_addr: str, output_addr: str, parent_pid: int | None):
        self.core = core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.last_stats_time = 0.0
        core.emit_early = self.send_outputs

    def run(self) -> None:
        # Lockstep DP ranks (expert parallel) must take every step together, idle or not: idle,
        # they wait on the socket for one nap at most, and a step in which no rank has work
        # runs nothing.
        lockstep = self.core.dp_lockstep
        was_busy = True
        while True:
            busy = self.core.has_unfinished_requests()
            if not busy:
                if was_busy:
                    self.publish_stats()  # once per busy->idle transition, so gauges settle at idle
                while not self.poller.poll(_LOCKSTEP_IDLE_POLL_MS if lockstep else _IDLE_POLL_MS):
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        logger.error("API process %d is gone; engine core exiting", self.parent_pid)
                        return
                    if lockstep:
                        break
            was_busy = busy
            self.drain_input()
            if lockstep or self.core.has_unfinished_requests():
                outputs: list[RequestOutput] = self.core.step()
                if outputs:
                    self.send_outputs(outputs)
                if time.monotonic() - self.last_stats_time > _STATS_PERIOD_S:
                    self.publish_stats()

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        self.output.send_multipart([b"OUT", self.encoder.encode(outputs)])

    def drain_input(self) -> None:
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            if kind == b"ADD":
                self.add_request(self.request_decoder.decode(frames[1]))
            elif kind == b"ABORT":
                self.core.abort_requests(self.abort_decoder.decode(frames[1]))
            elif kind == b"STATS":
                self.publish_stats()
            elif kind == b"WAKE":
                pass  # the step that follows is the point
            else:
                logger.error("unknown frame kind %r", kind)

    def add_request(self, req: EngineRequest) -> None:
        try:
            self.core.add_request(req)
        except ValueError as exc:
            self.reject(req.request_id, str(exc), 400)
        except Exception as exc:  # one bad request must not take the engine down
            logger.exception("add_request failed for %s", req.request_id)
            self.reject(req.request_id, f"engine error: {type(exc).__name__}: {exc}", 500)

    def reject(self, request_id: str, message: str, status: int) -> None:
        self.output.send_multipart([b"REJECT", self.encoder.encode([request_id, message, status])])

    def publish_stats(self) -> None:
        self.last_stats_time = time.monotonic()
        self.output.send_multipart([b"STATS", self.encoder.encode(self.core.get_stats()),
                                    str(self.core.dp_rank).encode()])

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, ready_pipe: Connection,
                    parent_pid: int | None = None, log_level: str = "info", dp_rank: int = 0) -> None:
    """Entry point of the engine core process (multiprocessing 'spawn' target).

    Reports ("ready", info) or ("error", traceback text) through ready_pipe, then serves
    until SIGTERM, parent death, or a fatal engine error (exit code 1).
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the API process leads the stop
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        from tandem.engine.core import EngineCore

        core = EngineCore(config, dp_rank)
    except BaseException:
        ready_pipe.send(("error", traceback.format_exc()))
        ready_pipe.close()
        sys.exit(1)
    loop = None
    try:
        loop = EngineCoreLoop(core, input_addr, output_addr, parent_pid)
        ready_pipe.send(("ready", {"max_model_len": core.max_model_len, "vocab_size": core.vocab_size,
                                   "eos_token_ids": sorted(core.eos_token_ids),
                                   "tokenizer_path": core.tokenizer_path}))
        ready_pipe.close()
        loop.run()
    except SystemExit:
        pass
    except BaseException:
        logger.exception("engine core failed; exiting")
        sys.exit(1)
    finally:
        core.shutdown()
        if loop is not None:
            loop.close()

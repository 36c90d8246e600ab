"""The API process's handle on the engine core process: spawns it, then talks to it over ZMQ.

Frames (multipart, msgpack via msgspec):
  API -> core (PUSH/PULL): [b"ADD", EngineRequest] | [b"ABORT", list[str]] | [b"STATS"]
  core -> API (PUSH/PULL): [b"OUT", list[RequestOutput]] | [b"STATS", SchedulerStats]
                           | [b"REJECT", [request_id, message, http_status]]
"""
import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.protocol import EngineRequest, RequestOutput, SchedulerStats
from server.errors import APIError, EngineDeadError

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core process failed to start; the message carries its traceback."""


class EngineInfo(msgspec.Struct):
    """What the engine core reports once ready."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_path: str


class RequestStream:
    """Async iterator over the RequestOutput deltas of one or more engine requests (one queue).

    Ends when every request has finished or been aborted through `abort`. Leaving the
    `async with` block (normally, by error, or by cancellation on client disconnect) aborts
    whatever is still running in the engine, so its KV blocks are freed.
    """

    def __init__(self, client: "EngineClient", request_ids: list[str]):
        self._client = client
        self._queue: asyncio.Queue = asyncio.Queue()
        self.pending = set(request_ids)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while self.pending:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.request_id not in self.pending:
                continue  # a late delta of a request aborted here
            if item.finished:
                self.pending.discard(item.request_id)
            return item
        raise StopAsyncIteration

    def abort(self, request_id: str) -> None:
        if request_id in self.pending:
            self.pending.discard(request_id)
            self._client.abort([request_id])

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self.pending:
            self._client.abort(list(self.pending))
            self.pending.clear()


class EngineClient:
    """Spawns the engine core process (`engine.core_proc.run_engine_core`) and exchanges
    requests/outputs with it. `start`/`wait_ready` are synchronous (before the event loop); the rest runs
    on the API process's event loop. Watches the core's liveness: if it dies, every open
    request fails with EngineDeadError and `on_dead` is called (the server then exits)."""

    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self.config = config
        self.log_level = log_level
        self.info: EngineInfo | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._ready_conn = None
        self.dead = False
        self.on_dead: Callable[[], None] | None = None
        self.last_stats = SchedulerStats()
        self._ipc_dir = tempfile.mkdtemp(prefix="tandem-")
        self.input_addr = f"ipc://{self._ipc_dir}/input"
        self.output_addr = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on send
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_addr)
        self._output: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._output_task: asyncio.Task | None = None
        self._closing = False
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(list[RequestOutput])
        self._stats_decoder = msgspec.msgpack.Decoder(SchedulerStats)

    # -- process lifetime (synchronous, main thread) ------------------------------------------
    def start(self) -> None:
        """Spawn the engine core process (returns at once; `wait_ready` blocks until it has loaded)."""
        from engine.core_proc import run_engine_core

        ctx = multiprocessing.get_context("spawn")
        self._ready_conn, child_conn = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_core, name="EngineCore",
                                args=(self.config, self.input_addr, self.output_addr, child_conn,
                                      os.getpid(), self.log_level))
        self.proc.start()
        child_conn.close()
        logger.info("engine core process started: pid=%d; waiting for it to load the model", self.proc.pid)

    def wait_ready(self) -> EngineInfo:
        """Block until the engine core reports ready; EngineStartupError (with its traceback) if it fails."""
        while not self._ready_conn.poll(0.5):
            if not self.proc.is_alive():
                raise EngineStartupError(f"engine core process exited during start-up (exit code "
                                         f"{self.proc.exitcode}) without reporting an error")
        try:
            kind, payload = self._ready_conn.recv()
        except EOFError as exc:
            raise EngineStartupError("engine core process closed its ready pipe without a word") from exc
        finally:
            self._ready_conn.close()
        if kind != "ready":
            raise EngineStartupError(f"engine core failed to start:\n{payload}")
        self.info = EngineInfo(**payload)
        logger.info("engine core ready: pid=%d max_model_len=%d vocab_size=%d",
                    self.proc.pid, self.info.max_model_len, self.info.vocab_size)
        return self.info

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (SIGTERM, then SIGKILL after `timeout`) and release the sockets."""
        self._closing = True
        if self.proc is not None and self.proc.is_alive():
            start = time.monotonic()
            self.proc.terminate()
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("engine core did not stop within %.0fs of SIGTERM; killing it", timeout)
                self.proc.kill()
                self.proc.join()
            logger.info("engine core stopped (exit code %s) in %.1fs", self.proc.exitcode, time.monotonic() - start)
        self._input.close(linger=0)
        if self._output is not None:
            self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- event loop side ----------------------------------------------------------------------
    async def start_output_loop(self) -> None:
        """Bind the output socket, start dispatching outputs, and watch the core's liveness."""
        self._output = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_addr)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-output-loop")
        if self.proc is not None:
            asyncio.get_running_loop().add_reader(self.proc.sentinel, self._on_core_exit)

    async def stop_output_loop(self) -> None:
        self._closing = True
        if self.proc is not None:
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()

    def add_requests(self, requests: list[EngineRequest]) -> RequestStream:
        """Send requests to the engine; iterate the returned stream for their outputs."""
        if self.dead:
            raise EngineDeadError()
        stream = RequestStream(self, [r.request_id for r in requests])
        for req in requests:
            self._queues[req.request_id] = stream._queue
            self._input.send_multipart([b"ADD", self._encoder.encode(req)], copy=False)
        return stream

    def add_request(self, request: EngineRequest) -> RequestStream:
        return self.add_requests([request])

    def abort(self, request_ids: list[str]) -> None:
        """Abort in the engine (frees their KV blocks); their later outputs are dropped."""
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and not self.dead:
            self._input.send_multipart([b"ABORT", self._encoder.encode(request_ids)])

    async def get_stats(self, timeout: float = 2.0) -> SchedulerStats:
        """Fresh SchedulerStats from the core (the last known ones if it does not answer in time)."""
        if self.dead:
            return self.last_stats
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        self._input.send_multipart([b"STATS", b""])
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            return self.last_stats

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    async def _output_loop(self) -> None:
        while True:
            kind, payload = await self._output.recv_multipart()
            if kind == b"OUT":
                for out in self._outputs_decoder.decode(payload):
                    queue = self._queues.get(out.request_id)
                    if queue is None:
                        continue
                    if out.finished:
                        del self._queues[out.request_id]
                    queue.put_nowait(out)
            elif kind == b"STATS":
                self.last_stats = self._stats_decoder.decode(payload)
                waiters, self._stats_waiters = self._stats_waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(self.last_stats)
            elif kind == b"REJECT":
                request_id, message, status = msgspec.msgpack.decode(payload)
                queue = self._queues.pop(request_id, None)
                if queue is not None:
                    queue.put_nowait(APIError(message, status=status))
            else:
                logger.error("unknown frame from the engine core: %r", kind)

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if self._closing:
            return
        self.proc.join(1.0)
        self.dead = True
        logger.error("engine core process died unexpectedly (pid=%d, exit code %s); failing %d open "
                     "request(s) and shutting the server down", self.proc.pid, self.proc.exitcode,
                     len(self._queues))
        queues, self._queues = self._queues, {}
        for queue in {id(q): q for q in queues.values()}.values():  # one stream may hold several ids
            queue.put_nowait(EngineDeadError())
        if self.on_dead is not None:
            self.on_dead()

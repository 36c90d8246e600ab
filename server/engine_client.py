"""The API process's handle on the engine core process(es): spawns them (one per data-parallel
rank), then talks to them over ZMQ.

Frames (multipart, msgpack via msgspec):
  API -> core (PUSH/PULL, one socket per rank): [b"ADD", EngineRequest] | [b"ABORT", list[str]] | [b"STATS"]
                                                | [b"WAKE"] (lockstep DP ranks: another rank got work)
  core -> API (PUSH/PULL, shared): [b"OUT", list[RequestOutput]] | [b"STATS", SchedulerStats, dp rank]
                                   | [b"REJECT", [request_id, message, http_status]]
"""
import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from tandem.engine.config import EngineConfig
from tandem.engine.protocol import EngineRequest, RequestOutput, SchedulerStats
from tandem.server.errors import APIError, EngineDeadError

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
    """Spawns the engine core process(es) (`engine.core_proc.run_engine_core`, one per data-parallel
    rank) and exchanges requests/outputs with them. `start`/`wait_ready` are synchronous (before
    the event loop); the rest runs on the API process's event loop. New requests go to the DP
    rank with the fewest open requests. Watches the cores' liveness: if one dies, every open
    request fails with EngineDeadError and `on_dead` is called (the server then exits)."""

    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self.config = config
        self.log_level = log_level
        self.num_ranks = config.parallel.data_parallel_size
        self.info: EngineInfo | None = None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._ready_conns = []
        self._start_cancelled = threading.Event()
        self.dead = False
        self.dead_exitcode: int | None = None
        self.on_dead: Callable[[], None] | None = None
        self._rank_stats = [SchedulerStats() for _ in range(self.num_ranks)]
        self._ipc_dir = tempfile.mkdtemp(prefix="tandem-")
        self.output_addr = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.Context()
        self._inputs = []
        for rank in range(self.num_ranks):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on send
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._ipc_dir}/input{rank}")
            self._inputs.append(sock)
        self._output: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._rank_of: dict[str, int] = {}
        self._open = [0] * self.num_ranks
        self._stats_waiters: list[asyncio.Future] = []
        self._stats_fresh: set[int] = set()
        self._output_task: asyncio.Task | None = None
        self._closing = False
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(list[RequestOutput])
        self._stats_decoder = msgspec.msgpack.Decoder(SchedulerStats)

    @property
    def proc(self) -> multiprocessing.process.BaseProcess | None:
        """The first engine core process (the only one without data parallelism)."""
        return self.procs[0] if self.procs else None

    @property
    def last_stats(self) -> SchedulerStats:
        """The latest stats of every DP rank, summed."""
        if self.num_ranks == 1:
            return self._rank_stats[0]
        total = SchedulerStats(**{f: sum(getattr(s, f) for s in self._rank_stats)
                                  for f in SchedulerStats.__struct_fields__ if f != "kv_cache_usage"})
        total.kv_cache_usage = 1.0 - total.num_free_blocks / max(total.num_total_blocks, 1)
        return total

    # -- process lifetime (synchronous, main thread) ------------------------------------------
    def start(self) -> None:
        """Spawn the engine core process(es) (returns at once; `wait_ready` blocks until loaded)."""
        from tandem.engine.core_proc import run_engine_core

        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.num_ranks):
            ready, child_conn = ctx.Pipe(duplex=False)
            name = "EngineCore" if self.num_ranks == 1 else f"EngineCore-DP{rank}"
            proc = ctx.Process(target=run_engine_core, name=name,
                               args=(self.config, f"ipc://{self._ipc_dir}/input{rank}", self.output_addr,
                                     child_conn, os.getpid(), self.log_level, rank))
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self._ready_conns.append(ready)
            logger.info("engine core process %s started: pid=%d; waiting for it to load the model", name, proc.pid)

    def wait_ready(self) -> EngineInfo:
        """Block until every engine core reports ready; EngineStartupError (with its traceback) if one fails."""
        for proc, conn in zip(self.procs, self._ready_conns):
            while not conn.poll(0.2):
                if self._start_cancelled.is_set():
                    raise EngineStartupError("start-up cancelled (the server is stopping)")
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise EngineStartupError(f"engine core process {dead[0].name} exited during start-up (exit "
                                             f"code {dead[0].exitcode}) without reporting an error")
            try:
                kind, payload = conn.recv()
            except EOFError as exc:
                raise EngineStartupError(f"engine core process {proc.name} closed its ready pipe without a word") from exc
            finally:
                conn.close()
            if kind != "ready":
                raise EngineStartupError(f"engine core failed to start ({proc.name}):\n{payload}")
            self.info = EngineInfo(**payload)
        logger.info("engine core ready: %d process(es), max_model_len=%d vocab_size=%d",
                    len(self.procs), self.info.max_model_len, self.info.vocab_size)
        return self.info

    def cancel_start(self) -> None:
        """Make a `wait_ready` blocked in another thread give up (the server stops while loading)."""
        self._start_cancelled.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine cores (SIGTERM, then SIGKILL after `timeout`) and release the sockets."""
        self._closing = True
        start = time.monotonic()
        alive = [p for p in self.procs if p.is_alive()]
        for proc in alive:
            proc.terminate()
        for proc in alive:
            proc.join(max(0.1, timeout - (time.monotonic() - start)))
            if proc.is_alive():
                logger.warning("engine core %s did not stop within %.0fs of SIGTERM; killing it", proc.name, timeout)
                proc.kill()
                proc.join()
            logger.info("engine core %s stopped (exit code %s) in %.1fs", proc.name, proc.exitcode,
                        time.monotonic() - start)
        for sock in self._inputs:
            sock.close(linger=0)
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
        for proc in self.procs:
            asyncio.get_running_loop().add_reader(proc.sentinel, self._on_core_exit, proc)

    async def stop_output_loop(self) -> None:
        self._closing = True
        for proc in self.procs:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()

    def add_requests(self, requests: list[EngineRequest]) -> RequestStream:
        """Send requests to the engine; iterate the returned stream for their outputs."""
        if self.dead:
            raise EngineDeadError()
        stream = RequestStream(self, [r.request_id for r in requests])
        rank = min(range(self.num_ranks), key=self._open.__getitem__)  # one stream's requests share a prompt
        for req in requests:
            self._queues[req.request_id] = stream._queue
            self._rank_of[req.request_id] = rank
            self._open[rank] += 1
            self._inputs[rank].send_multipart([b"ADD", self._encoder.encode(req)], copy=False)
        if self.config.parallel.lockstep_dp:  # idle lockstep ranks nap between steps: have them all step now
            for other in range(self.num_ranks):
                if other != rank:
                    self._inputs[other].send_multipart([b"WAKE"])
        return stream

    def _forget(self, request_id: str) -> int | None:
        """Drop a request's routing state; returns the rank it ran on."""
        self._queues.pop(request_id, None)
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self._open[rank] -= 1
        return rank

    def add_request(self, request: EngineRequest) -> RequestStream:
        return self.add_requests([request])

    def abort(self, request_ids: list[str]) -> None:
        """Abort in the engine (frees their KV blocks); their later outputs are dropped."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._forget(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        if not self.dead:
            for rank, ids in by_rank.items():
                self._inputs[rank].send_multipart([b"ABORT", self._encoder.encode(ids)])

    async def get_stats(self, timeout: float = 2.0) -> SchedulerStats:
        """Fresh SchedulerStats from the core (the last known ones if it does not answer in time)."""
        if self.dead:
            return self.last_stats
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        self._stats_fresh.clear()
        for sock in self._inputs:
            sock.send_multipart([b"STATS", b""])
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            return self.last_stats

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    async def _output_loop(self) -> None:
        while True:
            kind, payload, *rest = await self._output.recv_multipart()
            if kind == b"OUT":
                for out in self._outputs_decoder.decode(payload):
                    queue = self._queues.get(out.request_id)
                    if queue is None:
                        continue
                    if out.finished:
                        self._forget(out.request_id)
                    queue.put_nowait(out)
            elif kind == b"STATS":
                rank = int(rest[0]) if rest else 0
                self._rank_stats[rank] = self._stats_decoder.decode(payload)
                self._stats_fresh.add(rank)
                if len(self._stats_fresh) < self.num_ranks:
                    continue
                waiters, self._stats_waiters = self._stats_waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(self.last_stats)
            elif kind == b"REJECT":
                request_id, message, status = msgspec.msgpack.decode(payload)
                queue = self._queues.get(request_id)
                self._forget(request_id)
                if queue is not None:
                    queue.put_nowait(APIError(message, status=status))
            else:
                logger.error("unknown frame from the engine core: %r", kind)

    def _on_core_exit(self, proc: multiprocessing.process.BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._closing or self.dead:
            return
        proc.join(1.0)
        self.dead = True
        self.dead_exitcode = proc.exitcode
        logger.error("engine core process %s died unexpectedly (pid=%d, exit code %s); failing %d open "
                     "request(s) and shutting the server down", proc.name, proc.pid, proc.exitcode,
                     len(self._queues))
        queues, self._queues = self._queues, {}
        self._rank_of.clear()
        self._open = [0] * self.num_ranks
        for queue in {id(q): q for q in queues.values()}.values():  # one stream may hold several ids
            queue.put_nowait(EngineDeadError())
        if self.on_dead is not None:
            self.on_dead()

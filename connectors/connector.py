"""TandemConnector: moves prompt KV between a prefill and a decode instance.

Read mode (decode pulls): prefill finishes the prompt, holds its blocks and returns
their ids; decode allocates blocks, reads them, tells prefill to free.
Write mode (prefill pushes): decode allocates blocks and tells prefill where they
are; prefill waits for that, then writes each layer's KV right after computing it
and signals completion.

The scheduler talks to it at fixed points (engine/scheduler.py SchedulerConnector);
the KV agent's threads do the transfers. Shared state is guarded by one lock.
"""
import logging
import threading
import time
import uuid

import torch

from tandem.connectors.agent import KVAgent, TransferError
from tandem.connectors.protocol import DecodeBlocks, FreeBlocks, KVLayout, TransferDone, WriteBlocks
from tandem.connectors.staging import scatter_blocks
from tandem.connectors.transport import make_transport
from tandem.engine.config import KVTransferConfig
from tandem.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TandemConnector:
    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, layout: KVLayout):
        if config.kv_role not in (PRODUCER, CONSUMER, BOTH):
            raise ValueError(f"kv_role must be one of {PRODUCER}, {CONSUMER}, {BOTH}; got {config.kv_role!r}")
        extra = config.kv_connector_extra_config
        self.role = config.kv_role
        self.block_size = layout.block_size
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", 30.0))
        self.hold_timeout_s = float(extra.get("hold_timeout_s", 60.0))
        self.recompute_on_failure = bool(extra.get("recompute_on_failure", False))
        self.engine_id = extra.get("engine_id") or uuid.uuid4().hex[:12]
        self.kv_cache = kv_cache
        self.agent = KVAgent(self.engine_id, kv_cache, layout, extra.get("kv_host", "127.0.0.1"),
                             int(extra.get("handshake_port", 0)), self.transfer_timeout_s, self._on_message)
        self.transport = make_transport(extra.get("transport", "tcp"), kv_cache, self.agent)
        self.agent.transport = self.transport
        self.lock = threading.Lock()
        self.landed: set[str] = set()
        self.failed: dict[str, str] = {}
        self.releasable: set[str] = set()
        self.held: dict[str, float] = {}  # prefill, read mode: request id -> deadline to free
        self.receiving: dict[str, tuple[str, float]] = {}  # decode: transfer/request id -> (request id, deadline)
        self.reading: set[str] = set()  # decode, read mode: requests whose pull is in flight
        self.cancelled: set[str] = set()  # decode, read mode: finished while their pull was in flight
        self.targets: dict[str, DecodeBlocks] = {}  # prefill, write mode: transfer id -> decode's blocks
        self.awaiting_targets: dict[str, float] = {}  # prefill, write mode: request id -> deadline
        self.pushed_chunks: dict[str, int] = {}  # prefill, write mode: chunks pushed per request
        # Decode, write mode, transports whose peers write our memory directly (ipc, mori, nixl): a
        # receive that ended early keeps its blocks until prefill says its pushes are over (any
        # TransferDone) or a timeout, so a late push cannot land in blocks handed to another request.
        self.draining: dict[str, tuple[str, float]] = {}  # transfer id -> (request id, deadline)
        self.peer_writes_memory = bool(getattr(self.transport, "peer_writes_memory", False))
        logger.info("KV connector %s (%s) listening at %s", self.engine_id, self.role, self.agent.address)

    @property
    def address(self) -> str:
        return self.agent.address

    # ---- messages from peers (agent server thread) -------------------------------------

    def _on_message(self, msg, payload) -> None:
        with self.lock:
            if isinstance(msg, FreeBlocks):
                if self.held.pop(msg.request_id, None) is not None:
                    self.releasable.add(msg.request_id)
            elif isinstance(msg, DecodeBlocks):
                self.targets[msg.transfer_id] = msg
            elif isinstance(msg, WriteBlocks):
                # Only while the request still owns its blocks (not aborted meanwhile).
                if msg.transfer_id in self.receiving:
                    scatter_blocks(self.kv_cache, msg.block_ids, payload, msg.layer)
            elif isinstance(msg, TransferDone):
                drained = self.draining.pop(msg.transfer_id, None)
                if drained is not None:
                    self.releasable.add(drained[0])
                entry = self.receiving.pop(msg.transfer_id, None)
                if entry is not None:
                    if msg.error:
                        self.failed[entry[0]] = f"KV transfer failed on the prefill instance: {msg.error}"
                    else:
                        self.landed.add(entry[0])

    # ---- scheduler side ----------------------------------------------------------------

    @staticmethod
    def _params(req: Request) -> dict:
        return req.kv_transfer_params or {}

    def num_remote_tokens(self, req: Request, num_local_computed: int) -> int:
        p = self._params(req)
        if not p.get("do_remote_prefill"):
            return 0
        n = max(0, req.num_prompt_tokens - 1 - num_local_computed)
        if n == 0:
            # Nothing to receive, but the prefill holds blocks (read) or waits to hear where to
            # write (write): release it.
            msg = (DecodeBlocks(p["transfer_id"], self.engine_id, []) if p.get("mode") == "write"
                   else FreeBlocks(p["remote_request_id"]))
            self.agent.submit(lambda: self._send_or_fail(self._peer_of(p), msg, req.request_id))
        return n

    def ready(self, req: Request) -> bool:
        """Prefill, write mode: start only once decode has said where the KV goes."""
        p = self._params(req)
        if not (p.get("do_remote_decode") and p.get("mode") == "write"):
            return True
        with self.lock:
            if p["transfer_id"] in self.targets:
                self.awaiting_targets.pop(req.request_id, None)
                return True
            self.awaiting_targets.setdefault(req.request_id, time.monotonic() + self.transfer_timeout_s)
            return False

    def on_blocks_allocated(self, req: Request, num_remote_tokens: int) -> None:
        p = self._params(req)
        first = (req.remote_computed_tokens - num_remote_tokens) // self.block_size
        last = _cdiv(req.remote_computed_tokens, self.block_size)
        peer = f"{p['remote_host']}:{p['remote_port']}"
        deadline = time.monotonic() + self.transfer_timeout_s
        if p.get("mode") == "write":
            targets = [-1] * first + req.block_ids[first:last]
            with self.lock:
                self.receiving[p["transfer_id"]] = (req.request_id, deadline)
            msg = DecodeBlocks(p["transfer_id"], self.engine_id, targets)
            self.agent.submit(lambda: self._send_or_fail(peer, msg, req.request_id))
            return
        remote, local = p["remote_block_ids"][first:last], req.block_ids[first:last]
        with self.lock:
            self.reading.add(req.request_id)
        self.agent.submit(lambda: self._pull(peer, req.request_id, p["remote_request_id"], remote, local))

    def _send_or_fail(self, peer: str, msg, request_id: str) -> None:
        try:
            self.agent.send(peer, msg)
        except TransferError as e:
            with self.lock:
                if self.receiving.pop(getattr(msg, "transfer_id", None), None) is not None:
                    self.failed[request_id] = str(e)

    def _pull(self, peer: str, request_id: str, remote_request_id: str, remote: list[int], local: list[int]) -> None:
        error = None
        try:
            self.agent.session(peer)
            self.transport.read(peer, remote_request_id, remote, local)
        except (TransferError, ValueError, RuntimeError) as e:
            error = str(e)
        try:
            self.agent.send(peer, FreeBlocks(remote_request_id))
        except TransferError as e:
            logger.warning("could not tell %s to free %s: %s", peer, remote_request_id, e)
        with self.lock:
            self.reading.discard(request_id)
            if request_id in self.cancelled:
                self.cancelled.discard(request_id)
                self.releasable.add(request_id)
            elif error:
                self.failed[request_id] = error
            else:
                self.landed.add(request_id)

    def poll(self) -> tuple[set[str], dict[str, str], set[str]]:
        now = time.monotonic()
        with self.lock:
            for rid, deadline in list(self.held.items()):
                if now > deadline:
                    logger.warning("freeing KV blocks of %s: no decode read them within %.0f s", rid,
                                   self.hold_timeout_s)
                    del self.held[rid]
                    self.releasable.add(rid)
            for tid, (rid, deadline) in list(self.receiving.items()):
                if now > deadline:
                    del self.receiving[tid]
                    self.failed[rid] = f"KV transfer timed out after {self.transfer_timeout_s:.0f} s"
                    self._drain(tid, rid, now)
            for tid, (rid, deadline) in list(self.draining.items()):
                if now > deadline:
                    del self.draining[tid]
                    self.releasable.add(rid)
            for rid, deadline in list(self.awaiting_targets.items()):
                if now > deadline:
                    del self.awaiting_targets[rid]
                    self.failed[rid] = (f"the decode instance did not send its KV block ids within "
                                        f"{self.transfer_timeout_s:.0f} s")
            out = (self.landed, self.failed, self.releasable)
            self.landed, self.failed, self.releasable = set(), {}, set()
        return out

    def _drain(self, transfer_id: str, request_id: str, now: float) -> None:
        """Under the lock: hold an unfinished receive's blocks while the peer may still write them."""
        if self.peer_writes_memory:
            self.draining[transfer_id] = (request_id, now + self.transfer_timeout_s)

    def on_request_finished(self, req: Request) -> tuple[bool, dict | None]:
        p = self._params(req)
        ok = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if p.get("do_remote_decode"):
            return self._producer_finished(req, p, ok)
        if p.get("do_remote_prefill"):
            with self.lock:
                tid = p.get("transfer_id", "")
                if self.receiving.pop(tid, None) is not None:
                    self._drain(tid, req.request_id, time.monotonic())
                if tid in self.draining:
                    return True, None
                if req.request_id in self.reading:  # a pull is writing into these blocks right now
                    self.cancelled.add(req.request_id)
                    return True, None
        return False, None

    def _producer_finished(self, req: Request, p: dict, ok: bool) -> tuple[bool, dict | None]:
        with self.lock:
            self.awaiting_targets.pop(req.request_id, None)
            self.pushed_chunks.pop(req.request_id, None)
            target = self.targets.pop(p["transfer_id"], None) if p.get("mode") == "write" else None
        if p.get("mode") == "write":
            if target is None:
                return False, None
            # Pushes may still be reading our blocks (ipc): free them after a flush. A request that
            # ended early also tells decode, so it fails now instead of at its timeout.
            peer, tid, rid = self._peer_of(p), p["transfer_id"], req.request_id
            error = None if ok else (req.error or "the prefill request was aborted")

            def release() -> None:
                try:
                    self.transport.flush(peer)
                    if error is not None:
                        self.agent.send(peer, TransferDone(tid, error=error))
                finally:
                    with self.lock:
                        self.releasable.add(rid)

            self.agent.submit(release)
            return True, {"transfer_id": tid} if ok else None
        if not ok:
            return False, None
        with self.lock:
            self.held[req.request_id] = time.monotonic() + self.hold_timeout_s
        host, port = self.agent.address.rsplit(":", 1)
        return True, {"do_remote_prefill": True, "remote_engine_id": self.engine_id,
                      "remote_block_ids": list(req.block_ids), "remote_host": host, "remote_port": int(port),
                      "remote_request_id": req.request_id}

    @staticmethod
    def _peer_of(p: dict) -> str:
        return f"{p['remote_host']}:{p['remote_port']}"

    # ---- worker side: layer-wise push (prefill, write mode) -----------------------------

    def layer_hook(self, scheduled: list[tuple[Request, int]]):
        """A callback for the model runner, or None when nothing in this batch is pushed."""
        pushes = []
        for req, n in scheduled:
            p = self._params(req)
            if not (p.get("do_remote_decode") and p.get("mode") == "write"):
                continue
            with self.lock:
                target = self.targets.get(p["transfer_id"])
                first_chunk = self.pushed_chunks.get(req.request_id, 0) == 0
                self.pushed_chunks[req.request_id] = self.pushed_chunks.get(req.request_id, 0) + 1
            end = min(req.num_computed_tokens + n, len(target.block_ids) * self.block_size,
                      req.num_prompt_tokens - 1)
            lo = 0 if first_chunk else req.num_computed_tokens // self.block_size
            idx = [i for i in range(lo, _cdiv(end, self.block_size)) if target.block_ids[i] >= 0]
            final = req.num_computed_tokens + n >= req.num_prompt_tokens
            pushes.append((p, [req.block_ids[i] for i in idx], [target.block_ids[i] for i in idx], final))
        if not pushes:
            return None
        num_layers = self.kv_cache.shape[1]

        def on_layer_stored(layer: int) -> None:
            for p, local, remote, final in pushes:
                peer, tid = self._peer_of(p), p["transfer_id"]
                if local:
                    staged = self.transport.stage_layer(layer, local)
                    self.agent.submit(lambda peer=peer, tid=tid, staged=staged, remote=remote:
                                      self._push(peer, tid, layer, staged, remote))
                if final and layer == num_layers - 1:
                    self.agent.submit(lambda peer=peer, tid=tid: self._finish_push(peer, tid))

        return on_layer_stored

    def _push(self, peer: str, transfer_id: str, layer: int, staged, remote: list[int]) -> None:
        self.agent.session(peer)  # handshake (and transport attach) on first use
        self.transport.write_layer(peer, transfer_id, layer, staged, remote)

    def _finish_push(self, peer: str, transfer_id: str) -> None:
        try:
            self.transport.flush(peer)
        except (RuntimeError, ValueError) as e:  # a layer did not land: decode fails now, not at its timeout
            self.agent.send(peer, TransferDone(transfer_id, error=str(e)))
            return
        self.agent.send(peer, TransferDone(transfer_id))

    def close(self) -> None:
        self.agent.close()
        self.transport.close()

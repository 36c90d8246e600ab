"""The KV connector's worker side: one per rank, next to the rank's KV cache.

It registers the rank's cache with the transport, answers the peer ranks (data handshake, block
reads, block writes) and does the rank's share of what each step's KVStepMeta lists: reads of
the rank pairs whose decode rank it is, pushes of the pairs whose prefill rank it is (layer by
layer during the forward pass, or every layer at a step's start for blocks computed earlier).
It never decides a transfer; it reports each finished pair (RankDone) to the scheduler side.
"""
import logging
from typing import Callable

import torch

from tandem.connectors.agent import KVAgent, TransferError
from tandem.connectors.layout import KVLayout, RankPair
from tandem.connectors.protocol import (BlocksData, Hello, HelloReply, KVStepMeta, PushOp, ReadBlocks, ReadOp,
                                        RankDone, WriteBlocks, WriteDone)
from tandem.connectors.staging import gather_blocks, scatter_blocks
from tandem.connectors.transport import make_transport

logger = logging.getLogger(__name__)

_MAX_CLOSED = 4096


class KVConnectorWorker:
    def __init__(self, engine_id: str, rank: int, kv_cache: torch.Tensor, layout: KVLayout, transport: str,
                 host: str, timeout_s: float, port: int = 0):
        """kv_cache: this rank's [2, layers, blocks, block_size, layout.heads_per_rank, head_dim];
        port: where this rank's agent listens (0: a free port)."""
        self.engine_id, self.rank, self.kv_cache, self.layout = engine_id, rank, kv_cache, layout
        self.agent = KVAgent(f"kv-data-{engine_id}-r{rank}", host, port, timeout_s, self._handle)
        self.transport = make_transport(transport, kv_cache, self.agent)
        self.notify: str | None = None  # the scheduler side's control address (set after the ranks meet)
        self.closed: dict[str, None] = {}  # write transfers over: late data is dropped (server thread reads)
        self.push_errors: dict[tuple[str, RankPair], str] = {}  # client thread only

    @property
    def address(self) -> str:
        return self.agent.address

    # ---- peers' requests (server thread) ------------------------------------------------------

    def _handle(self, msg, payload):
        if isinstance(msg, Hello):
            error = self.layout.mismatch(msg.layout)
            if msg.transport != self.transport.name:
                error = f"KV transports differ ({msg.transport} vs {self.transport.name})"
            return HelloReply(self.engine_id, self.layout, error, self.transport.name,
                              transport_info=b"" if error else self.transport.local_info()), None
        if isinstance(msg, ReadBlocks):
            try:
                data = gather_blocks(self.kv_cache, msg.block_ids, -1, msg.head, msg.num_heads)
            except (IndexError, RuntimeError) as e:
                return BlocksData(msg.request_id, error=f"bad block ids: {e}"), None
            return BlocksData(msg.request_id), data
        if isinstance(msg, WriteBlocks):
            if msg.transfer_id not in self.closed:
                scatter_blocks(self.kv_cache, msg.block_ids, payload, msg.layer, msg.head, msg.num_heads)
        elif isinstance(msg, WriteDone):
            done = RankDone(msg.pair, transfer_id=msg.transfer_id, error=msg.error)
            self.agent.submit(lambda: self._report(done))
        return None

    # ---- this step's work ---------------------------------------------------------------------

    def start(self, meta: KVStepMeta) -> None:
        """Before the step's forward pass (or alone, when nothing runs): start this rank's reads,
        pushes of blocks computed by earlier steps, and finishes; drop closed transfers."""
        self.notify = meta.notify
        for tid in meta.closed:
            self.closed[tid] = None
        while len(self.closed) > _MAX_CLOSED:
            del self.closed[next(iter(self.closed))]
        for op in meta.reads:
            for pair in op.pairs:
                if pair.dst_rank == self.rank:
                    self.agent.submit(lambda op=op, pair=pair: self._read(op, pair))
        for op in meta.pushes:
            if not op.layerwise:  # their KV is in the cache already (in stream order): every layer now
                for layer in range(self.kv_cache.shape[1]):
                    self._push_layer(op, layer)
        for op in meta.finishes:
            for pair in op.pairs:
                if pair.src_rank == self.rank:
                    peer = op.peer_ranks[pair.dst_rank]
                    self.agent.submit(lambda op=op, pair=pair, peer=peer:
                                      self._end_push(peer, op.request_id, op.transfer_id, pair, op.error))

    def layer_hook(self, meta: KVStepMeta | None) -> Callable[[int], None] | None:
        """The model's per-layer callback for this step's pushes from this rank (None: none)."""
        mine = [op for op in (meta.pushes if meta else []) if op.layerwise
                and any(pair.src_rank == self.rank for pair in op.pairs)]
        if not mine:
            return None

        def on_layer_stored(layer: int) -> None:
            for op in mine:
                self._push_layer(op, layer)

        return on_layer_stored

    def _push_layer(self, op: PushOp, layer: int) -> None:
        """Engine thread: capture `layer` of op's blocks (this rank's pairs) and queue its pushes;
        after the last layer of a final op, queue the pairs' completion reports."""
        for pair in op.pairs:
            if pair.src_rank != self.rank:
                continue
            peer = op.peer_ranks[pair.dst_rank]
            if op.local_blocks:
                staged = self.transport.stage_layer(layer, op.local_blocks, pair)
                self.agent.submit(lambda pair=pair, peer=peer, staged=staged:
                                  self._push(peer, op, pair, layer, staged))
            if op.final and layer == self.kv_cache.shape[1] - 1:
                self.agent.submit(lambda pair=pair, peer=peer:
                                  self._end_push(peer, op.request_id, op.transfer_id, pair, None))

    # ---- client thread ----------------------------------------------------------------------

    def _session(self, peer: str) -> None:
        reply, new = self.agent.hello(peer, Hello(self.engine_id, self.layout, self.transport.name, self.rank))
        if new:
            try:
                self.transport.attach(peer, reply.transport_info)
            except Exception as e:
                self.agent.forget(peer)
                raise TransferError(f"cannot attach to the KV cache of {reply.engine_id} at {peer}: {e}") from e

    def _read(self, op: ReadOp, pair: RankPair) -> None:
        error = None
        try:
            peer = op.peer_ranks[pair.src_rank]
            self._session(peer)
            self.transport.read(peer, op.remote_request_id, op.remote_blocks, op.local_blocks, pair)
        except (TransferError, ValueError, RuntimeError) as e:
            error = str(e)
        self._report(RankDone(pair, request_id=op.request_id, error=error))

    def _push(self, peer: str, op, pair: RankPair, layer: int, staged) -> None:
        if (op.transfer_id, pair) in self.push_errors:
            return
        try:
            self._session(peer)
            self.transport.write_layer(peer, op.transfer_id, layer, staged, op.remote_blocks, pair)
        except (TransferError, ValueError, RuntimeError) as e:
            self.push_errors[(op.transfer_id, pair)] = str(e)

    def _end_push(self, peer: str, request_id: str, transfer_id: str, pair: RankPair, error: str | None) -> None:
        error = self.push_errors.pop((transfer_id, pair), None) or error
        try:
            if peer in self.agent.hellos:
                self.transport.flush(peer)
        except Exception as e:  # a push did not land: decode must not take the blocks as filled
            error = error or f"KV push to {peer} failed: {e}"
        try:
            self.agent.send(peer, WriteDone(transfer_id, pair, error))
        except Exception as e:  # the pair is over either way; say why on our side
            error = error or f"KV push to {peer} failed: {e}"
        self._report(RankDone(pair, request_id=request_id, error=error))

    def _report(self, done: RankDone) -> None:
        if self.notify is not None:
            self.agent.send(self.notify, done)

    def close(self) -> None:
        self.agent.close()
        self.transport.close()

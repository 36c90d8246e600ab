"""NIXL transport (NVIDIA's inference transfer library, UCX backend): one-sided RDMA reads and
writes of KV blocks between instances, across nodes; also DRAM to DRAM on CPU (CI).

Each transport owns one NIXL agent and registers its whole KV cache with it (VRAM on a GPU,
DRAM on CPU). `local_info()` carries the agent's metadata and the cache's base address; the
peer loads it in `attach()`, so the existing ZMQ handshake is the only side channel.
A transfer is one NIXL request over a descriptor list with one descriptor per
(k|v, layer, run of consecutive blocks); between ranks of different TP sizes (a RankPair's head
slice) one per (k|v, layer, block, token slot), as heads are not contiguous in a block. Completion is NIXL's own request state: the UCX
backend ends every request with an endpoint flush, so DONE means the data is in the peer's
memory; the connector then signals over ZMQ as for every transport (TransferDone / FreeBlocks).
NIXL notifications are not used.
"""
import logging
import time

import msgspec
import numpy as np
import torch

logger = logging.getLogger(__name__)

EXTRA_HINT = "install the 'nixl' extra: pip install -e '.[nixl]' (NIXL wheels exist for Linux x86_64 and aarch64)"


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ValueError(f"the 'nixl' KV transport needs NIXL, which cannot be imported ({e}); {EXTRA_HINT}, "
                         "or use 'ipc' (one node) / 'tcp'") from e
    return nixl_agent, nixl_agent_config


class NixlPeerInfo(msgspec.Struct, frozen=True):
    """What a peer needs to reach this transport's KV cache (sent in the handshake)."""

    agent_metadata: bytes
    base_address: int
    num_blocks: int
    device_id: int
    mem_type: str  # "VRAM" | "DRAM"
    num_kv_heads: int = 0  # this rank's heads (ranks of different TP sizes hold different counts)


def block_runs(local: list[int], remote: list[int]) -> np.ndarray:
    """[runs, 3] (local_start, remote_start, length): maximal runs where both sides' block ids
    go up by one, so consecutive blocks move as one region."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks for {len(remote)} remote blocks")
    if not local:
        return np.zeros((0, 3), dtype=np.int64)
    lo, re = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(lo) != 1) | (np.diff(re) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(lo)])))
    return np.stack([lo[starts], re[starts], lengths], axis=1)


def region_descs(base: int, num_layers: int, num_blocks: int, block_bytes: int, device_id: int,
                 layers: range, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[2 * len(layers) * runs, 3] NIXL descriptors (address, bytes, device) of the regions
    cache[kv, layer, start:start + length] of a cache [2, num_layers, num_blocks, ...] at base."""
    kv = np.arange(2, dtype=np.int64)[:, None, None]
    layer = np.asarray(layers, dtype=np.int64)[None, :, None]
    first = ((kv * num_layers + layer) * num_blocks + starts[None, None, :]) * block_bytes + base
    length = np.broadcast_to(lengths[None, None, :] * block_bytes, first.shape)
    out = np.empty((first.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = first.reshape(-1), length.reshape(-1), device_id
    return out


def head_descs(base: int, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_bytes: int,
               device_id: int, layers: range, blocks: np.ndarray, head: int, num_heads: int) -> np.ndarray:
    """[2 * len(layers) * len(blocks) * block_size, 3] descriptors of the heads head:head + num_heads
    of every token slot of the blocks: a head slice of a [block_size, kv_heads, head_dim] block is
    not contiguous, so ranks of different TP sizes move one region per token slot."""
    kv = np.arange(2, dtype=np.int64)[:, None, None, None]
    layer = np.asarray(layers, dtype=np.int64)[None, :, None, None]
    block = np.asarray(blocks, dtype=np.int64)[None, None, :, None]
    slot = np.arange(block_size, dtype=np.int64)[None, None, None, :]
    first = ((((kv * num_layers + layer) * num_blocks + block) * block_size + slot) * num_kv_heads + head) * head_bytes
    out = np.empty((first.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = first.reshape(-1) + base, num_heads * head_bytes, device_id
    return out


class NixlTransport:
    """KV blocks over NIXL. All calls but stage_layer come from one thread (the KV agent's
    client thread); the NIXL agent runs its own progress thread."""

    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, timeout_s: float = 30.0,
                 backends: tuple[str, ...] = ("UCX",)):
        nixl_agent, nixl_agent_config = _import_nixl()
        if not kv_cache.is_contiguous():
            raise ValueError("the nixl KV transport registers the KV cache as one region; it must be contiguous")
        self.kv_cache, self.timeout_s = kv_cache, timeout_s
        self.num_layers, self.num_blocks = kv_cache.shape[1], kv_cache.shape[2]
        self.block_size, self.num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
        self.block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.head_bytes = kv_cache.shape[5] * kv_cache.element_size()
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.get_device() if kv_cache.is_cuda else 0
        self.nixl = nixl_agent(agent_name, nixl_agent_config(backends=list(backends)))
        missing = [b for b in backends if b not in self.nixl.backends]
        if missing:
            raise ValueError(f"NIXL has no {', '.join(missing)} backend here (plugins: {self.nixl.plugin_list}); "
                             f"{EXTRA_HINT}")
        self.registration = self.nixl.register_memory(kv_cache)
        # Cached: local_info() is asked on the agent's server thread, the NIXL agent is not thread-safe.
        self.info = msgspec.msgpack.encode(NixlPeerInfo(self.nixl.get_agent_metadata(), kv_cache.data_ptr(),
                                                        self.num_blocks, self.device_id, self.mem_type,
                                                        self.num_kv_heads))
        self.peers: dict[str, tuple[str, NixlPeerInfo]] = {}  # peer address -> (NIXL agent name, info)
        self.pending: dict[str, list[tuple[int, object]]] = {}  # peer address -> [(layer, xfer handle)]
        self.failed: dict[str, Exception] = {}  # peer address -> first write that failed since the last flush
        logger.info("NIXL agent %s registered the KV cache (%s, %.1f MiB)", agent_name, self.mem_type,
                    kv_cache.numel() * kv_cache.element_size() / 2**20)

    def local_info(self) -> bytes:
        return self.info

    def attach(self, peer: str, info: bytes) -> None:
        if not info:
            raise ValueError(f"the peer at {peer} did not send NIXL metadata (is it using another transport?)")
        remote = msgspec.msgpack.decode(info, type=NixlPeerInfo)
        old = self.peers.pop(peer, None)
        if old is not None:  # the peer restarted at the same address: forget its old agent
            self.nixl.remove_remote_agent(old[0])
        self.peers[peer] = (self.nixl.add_remote_agent(remote.agent_metadata), remote)

    def _descs(self, peer: str, layers: range, local_blocks: list[int], remote_blocks: list[int],
               heads: tuple[int, int, int] | None):
        """heads: (local head, remote head, count) of a rank pair, or None for all heads of both."""
        name, remote = self.peers[peer]
        runs = block_runs(local_blocks, remote_blocks)
        if len(runs) and (runs[:, 0].min() < 0 or (runs[:, 0] + runs[:, 2]).max() > self.num_blocks
                          or runs[:, 1].min() < 0 or (runs[:, 1] + runs[:, 2]).max() > remote.num_blocks):
            raise ValueError(f"block ids out of range (local {self.num_blocks}, remote {remote.num_blocks} blocks)")
        remote_heads = remote.num_kv_heads or self.num_kv_heads
        if heads is None and remote_heads != self.num_kv_heads:
            raise ValueError(f"KV heads differ ({self.num_kv_heads} here, {remote_heads} at {peer}): name a rank pair")
        if heads is None or heads[2] == self.num_kv_heads == remote_heads:  # whole blocks, coalesced runs
            local = region_descs(self.kv_cache.data_ptr(), self.num_layers, self.num_blocks, self.block_bytes,
                                 self.device_id, layers, runs[:, 0], runs[:, 2])
            far = region_descs(remote.base_address, self.num_layers, remote.num_blocks,
                               self.block_size * remote_heads * self.head_bytes, remote.device_id, layers,
                               runs[:, 1], runs[:, 2])
        else:
            local = head_descs(self.kv_cache.data_ptr(), self.num_layers, self.num_blocks, self.block_size,
                               self.num_kv_heads, self.head_bytes, self.device_id, layers, local_blocks,
                               heads[0], heads[2])
            far = head_descs(remote.base_address, self.num_layers, remote.num_blocks, self.block_size, remote_heads,
                             self.head_bytes, remote.device_id, layers, remote_blocks, heads[1], heads[2])
        return (name, self.nixl.get_xfer_descs(local, self.mem_type),
                self.nixl.get_xfer_descs(far, remote.mem_type))

    def _post(self, op: str, peer: str, layers: range, local_blocks: list[int], remote_blocks: list[int],
              heads: tuple[int, int, int] | None = None):
        name, local, remote = self._descs(peer, layers, local_blocks, remote_blocks, heads)
        handle = self.nixl.initialize_xfer(op, local, remote, name)
        if self.nixl.transfer(handle) == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL {op} to {peer} failed to start")
        return handle

    def _wait(self, peer: str, handle) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (state := self.nixl.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                self._release(handle)
                raise RuntimeError(f"NIXL transfer with {peer} did not finish within {self.timeout_s:.0f} s")
            time.sleep(0.0001)
        self._release(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer with {peer} failed ({state})")

    def _release(self, handle) -> None:
        try:
            handle.release()
        except Exception as e:  # an in-flight request NIXL cannot cancel; it is retried at agent teardown
            logger.warning("NIXL could not release a transfer request: %s", e)

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int],
             pair=None) -> None:
        """Read mode (we decode): pull every layer of the peer's remote_blocks into our local_blocks,
        all heads or a RankPair's (src_head on the peer, dst_head here, num_heads); blocks until landed."""
        if remote_blocks:
            heads = None if pair is None else (pair.dst_head, pair.src_head, pair.num_heads)
            self._wait(peer, self._post("READ", peer, range(self.num_layers), local_blocks, remote_blocks, heads))

    def stage_layer(self, layer: int, local_blocks: list[int], pair=None):
        """Engine thread, right after the layer's KV store: an event the push waits for, not the model."""
        event = None
        if self.kv_cache.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return event, layer, local_blocks

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int],
                    pair=None) -> None:
        """Write mode (we prefill): post a WRITE of one layer of our blocks (all heads or a RankPair's,
        src_head here, dst_head on the peer) into the peer's; flush(peer) waits for it."""
        event, layer, local_blocks = staged
        heads = None if pair is None else (pair.src_head, pair.dst_head, pair.num_heads)
        if event is not None:
            event.synchronize()
        pending = self.pending.setdefault(peer, [])
        try:
            # A later chunk may rewrite a block an earlier chunk's push of this layer still carries: keep their order.
            for entry in [e for e in pending if e[0] == layer]:
                pending.remove(entry)
                self._wait(peer, entry[1])
            pending.append((layer, self._post("WRITE", peer, range(layer, layer + 1), local_blocks, remote_blocks,
                                              heads)))
        except (RuntimeError, ValueError) as e:
            self.failed.setdefault(peer, e)  # flush must not report a push with a missing layer as landed
            raise

    def flush(self, peer: str) -> None:
        """Return once every write to peer so far has landed in its memory; raise if one failed."""
        pending, error = self.pending.pop(peer, []), self.failed.pop(peer, None)
        for _, handle in pending:
            try:
                self._wait(peer, handle)
            except RuntimeError as e:
                error = error or e
        if error is not None:
            raise RuntimeError(f"a NIXL write to {peer} failed: {error}") from error

    def close(self) -> None:
        for peer in list(self.pending):
            try:
                self.flush(peer)
            except RuntimeError as e:
                logger.warning("closing the NIXL transport: %s", e)
        for name, _ in self.peers.values():
            self.nixl.remove_remote_agent(name)
        self.peers.clear()
        self.nixl.deregister_memory(self.registration)

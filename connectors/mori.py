"""MoRI-IO RDMA transport (ROCm): each rank registers its KV cache with a MoRI IOEngine and
moves the heads of blocks a rank pair needs with batched one-sided reads/writes (whole blocks
when the pair covers every head, one entry per token slot otherwise). Imported only when selected; needs the `mori`
package (ROCm). Written against mori.io's published Python API (IOEngine, EngineDesc,
MemoryDesc, batch_read/batch_write, TransferStatus); not exercised on this project's CI.
"""
import pickle
import time

import torch

from tandem.connectors.layout import RankPair


def _import_mori():
    try:
        from mori import cpp as mori_cpp
        from mori.io import IOEngine
    except ImportError as e:
        raise ValueError("the 'mori' KV transport needs MoRI (ROCm); install it or use 'ipc' / 'tcp'") from e
    return mori_cpp, IOEngine


class MoriTransport:
    name = "mori"

    def __init__(self, kv_cache: torch.Tensor, agent, port: int = 0):
        """agent: the rank's KVAgent (its name, e.g. "kv-data-<engine>-r<rank>", names the IOEngine)."""
        mori_cpp, IOEngine = _import_mori()
        self.mori = mori_cpp
        self.kv_cache = kv_cache
        host = agent.address.rsplit(":", 1)[0]
        self.engine = IOEngine(f"tandem-{agent.name}", mori_cpp.IOEngineConfig(host=host, port=port))
        self.engine.create_backend(mori_cpp.BackendType.RDMA)
        self.mem = self.engine.register_torch_tensor(kv_cache)
        self.peers: dict[str, tuple] = {}
        shape = kv_cache.shape  # [2, layers, blocks, block_size, heads, head_dim]
        self.num_layers, self.num_blocks, self.block_size, self.num_heads = shape[1], shape[2], shape[3], shape[4]
        self.head_bytes = shape[5] * kv_cache.element_size()

    def local_info(self) -> bytes:
        return pickle.dumps((self.engine.get_engine_desc().pack(), self.mem.pack(), self.num_blocks, self.num_heads))

    def attach(self, peer: str, info: bytes) -> None:
        engine_desc, mem_desc, num_blocks, num_heads = pickle.loads(info)
        engine_desc = self.mori.EngineDesc.unpack(engine_desc)
        self.engine.register_remote_engine(engine_desc)
        self.peers[peer] = (engine_desc, self.mori.MemoryDesc.unpack(mem_desc), num_blocks, num_heads)

    def _entries(self, blocks: list[int], layers: range, head: int, num_heads: int, num_blocks_there: int,
                 heads_there: int) -> tuple[list[int], int]:
        """(byte offsets, bytes per entry) of heads [head, head + num_heads) of blocks in a cache
        of num_blocks_there blocks of heads_there heads."""
        slot = heads_there * self.head_bytes
        block = self.block_size * slot
        starts = [((kv * self.num_layers + l) * num_blocks_there + b) * block
                  for kv in (0, 1) for l in layers for b in blocks]
        if num_heads == heads_there:
            return starts, block
        return [s + i * slot + head * self.head_bytes for s in starts for i in range(self.block_size)], \
            num_heads * self.head_bytes

    def _wait(self, status) -> None:
        while status.InProgress():
            time.sleep(0.0001)
        if not status.Succeeded():
            raise RuntimeError(f"MoRI-IO transfer failed: {status.Message()}")

    def _transfer(self, op, peer: str, local_blocks: list[int], remote_blocks: list[int], layers: range,
                  pair: RankPair, local_head: int, remote_head: int) -> None:
        _, remote_mem, remote_blocks_total, remote_heads = self.peers[peer]
        local, size = self._entries(local_blocks, layers, local_head, pair.num_heads, self.num_blocks, self.num_heads)
        remote, _ = self._entries(remote_blocks, layers, remote_head, pair.num_heads, remote_blocks_total,
                                  remote_heads)
        self._wait(op(self.mem, local, remote_mem, remote, [size] * len(local), self.engine.allocate_transfer_uid()))

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int],
             pair: RankPair) -> None:
        self._transfer(self.engine.batch_read, peer, local_blocks, remote_blocks, range(self.num_layers), pair,
                       pair.dst_head, pair.src_head)

    def stage_layer(self, layer: int, local_blocks: list[int], pair: RankPair):
        torch.cuda.current_stream().synchronize()  # RDMA reads device memory directly
        return layer, local_blocks

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int],
                    pair: RankPair) -> None:
        layer, local_blocks = staged
        self._transfer(self.engine.batch_write, peer, local_blocks, remote_blocks, range(layer, layer + 1), pair,
                       pair.src_head, pair.dst_head)

    def flush(self, peer: str) -> None:
        pass  # write_layer waits for completion

    def close(self) -> None:
        pass

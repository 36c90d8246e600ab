"""MoRI-IO RDMA transport (ROCm): registers the KV cache with a MoRI IOEngine and moves
blocks with batched one-sided reads/writes. Imported only when selected; needs the `mori`
package (ROCm). Written against mori.io's published Python API (IOEngine, EngineDesc,
MemoryDesc, batch_read/batch_write, TransferStatus); not exercised on this project's CI.
"""
import pickle
import time

import torch


def _import_mori():
    try:
        from mori import cpp as mori_cpp
        from mori.io import IOEngine
    except ImportError as e:
        raise ValueError("the 'mori' KV transport needs MoRI (ROCm); install it or use 'ipc' / 'tcp'") from e
    return mori_cpp, IOEngine


class MoriTransport:
    name = "mori"
    peer_writes_memory = True  # write mode: the prefill writes our KV cache directly

    def __init__(self, kv_cache: torch.Tensor, agent, port: int = 0):
        mori_cpp, IOEngine = _import_mori()
        self.mori = mori_cpp
        self.kv_cache = kv_cache
        host = agent.address.rsplit(":", 1)[0]
        self.engine = IOEngine(f"tandem-{agent.engine_id}", mori_cpp.IOEngineConfig(host=host, port=port))
        self.engine.create_backend(mori_cpp.BackendType.RDMA)
        self.mem = self.engine.register_torch_tensor(kv_cache)
        self.peers: dict[str, tuple] = {}
        # Byte offsets of block b of layer l of k|v, for batched transfers of whole blocks.
        self.block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.num_layers, self.num_blocks = kv_cache.shape[1], kv_cache.shape[2]

    def local_info(self) -> bytes:
        return pickle.dumps((self.engine.get_engine_desc().pack(), self.mem.pack()))

    def attach(self, peer: str, info: bytes) -> None:
        engine_desc, mem_desc = pickle.loads(info)
        engine_desc = self.mori.EngineDesc.unpack(engine_desc)
        self.engine.register_remote_engine(engine_desc)
        self.peers[peer] = (engine_desc, self.mori.MemoryDesc.unpack(mem_desc))

    def _offsets(self, blocks: list[int], layers: range) -> list[int]:
        return [((kv * self.num_layers + l) * self.num_blocks + b) * self.block_bytes
                for kv in (0, 1) for l in layers for b in blocks]

    def _wait(self, status) -> None:
        while status.InProgress():
            time.sleep(0.0001)
        if not status.Succeeded():
            raise RuntimeError(f"MoRI-IO transfer failed: {status.Message()}")

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int]) -> None:
        _, remote_mem = self.peers[peer]
        layers = range(self.num_layers)
        local, remote = self._offsets(local_blocks, layers), self._offsets(remote_blocks, layers)
        status = self.engine.batch_read(self.mem, local, remote_mem, remote, [self.block_bytes] * len(local),
                                        self.engine.allocate_transfer_uid())
        self._wait(status)

    def stage_layer(self, layer: int, local_blocks: list[int]):
        torch.cuda.current_stream().synchronize()  # RDMA reads device memory directly
        return layer, local_blocks

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int]) -> None:
        layer, local_blocks = staged
        _, remote_mem = self.peers[peer]
        local, remote = self._offsets(local_blocks, range(layer, layer + 1)), self._offsets(remote_blocks, range(layer, layer + 1))
        self._wait(self.engine.batch_write(self.mem, local, remote_mem, remote, [self.block_bytes] * len(local),
                                           self.engine.allocate_transfer_uid()))

    def flush(self, peer: str) -> None:
        pass  # write_layer waits for completion

    def close(self) -> None:
        pass

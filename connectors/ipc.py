"""GPU peer copies between instances on one node (CUDA IPC on NVIDIA, HIP IPC on AMD).

Each side exports its KV cache with an IPC memory handle at handshake; the peer opens
it and moves blocks device to device over NVLink/XGMI (or PCIe). A transfer is a few
batched ops regardless of the number of blocks: gather on the source, one peer copy,
scatter on the destination. Both GPUs must be visible to both processes (select each
instance's GPU with --device cuda:N, not CUDA_VISIBLE_DEVICES).
"""
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


class IpcTransport:
    name = "ipc"
    peer_writes_memory = True  # write mode: the prefill writes our KV cache directly

    def __init__(self, kv_cache: torch.Tensor):
        if not kv_cache.is_cuda:
            raise ValueError("the ipc KV transport needs the KV cache on a GPU; use 'tcp' on CPU")
        self.kv_cache = kv_cache
        self.peers: dict[str, torch.Tensor] = {}
        dev = kv_cache.device
        self.local_stream = torch.cuda.Stream(dev)
        self.remote_streams: dict[str, torch.cuda.Stream] = {}

    def local_info(self) -> bytes:
        _, args = reduce_tensor(self.kv_cache)
        return pickle.dumps(args)

    def attach(self, peer: str, info: bytes) -> None:
        if not info:
            raise ValueError(f"the peer at {peer} did not export its KV cache for ipc (is it using tcp?)")
        remote = rebuild_cuda_tensor(*pickle.loads(info))
        self.peers[peer] = remote
        self.remote_streams[peer] = torch.cuda.Stream(remote.device)

    def _index(self, blocks: list[int], device) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=device)

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int]) -> None:
        remote = self.peers[peer]
        with torch.cuda.device(remote.device), torch.cuda.stream(self.remote_streams[peer]):
            data = remote[:, :, self._index(remote_blocks, remote.device)]
        with torch.cuda.device(self.kv_cache.device), torch.cuda.stream(self.local_stream):
            self.local_stream.wait_stream(self.remote_streams[peer])
            self.kv_cache[:, :, self._index(local_blocks, self.kv_cache.device)] = data.to(self.kv_cache.device)
        self.local_stream.synchronize()

    def stage_layer(self, layer: int, local_blocks: list[int]):
        """Engine thread: an event after the layer's KV store, so the copy waits for it, not the model."""
        event = torch.cuda.Event()
        event.record()
        return event, layer, local_blocks

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int]) -> None:
        event, layer, local_blocks = staged
        remote, stream = self.peers[peer], self.remote_streams[peer]
        with torch.cuda.device(self.kv_cache.device), torch.cuda.stream(self.local_stream):
            self.local_stream.wait_event(event)
            data = self.kv_cache[:, layer, self._index(local_blocks, self.kv_cache.device)]
        with torch.cuda.device(remote.device), torch.cuda.stream(stream):
            stream.wait_stream(self.local_stream)
            remote[:, layer, self._index(remote_blocks, remote.device)] = data.to(remote.device, non_blocking=True)

    def flush(self, peer: str) -> None:
        self.remote_streams[peer].synchronize()

    def close(self) -> None:
        self.peers.clear()

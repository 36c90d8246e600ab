"""GPU peer copies between instances on one node (CUDA IPC on NVIDIA, HIP IPC on AMD).

Each rank exports its KV cache with an IPC memory handle at its data handshake; the peer rank
opens it in its own GPU's context (peer access, over NVLink/XGMI), so a transfer's kernels all
run on the GPU of the process that moves the data: a read gathers the peer's blocks straight over
the link into this GPU and scatters them into the local slots; a layer-wise write gathers the
local blocks and scatters them straight into the peer's slots. No kernel of this process runs on
the peer's GPU: there it would wait for the GPU's time slice between the two processes' contexts
(CUDA time-slices contexts of different processes), milliseconds per launch while the peer
serves. Where the two GPUs have no peer access, the handle opens on the peer's GPU and the data
takes one device-to-device copy between a gather there and a scatter here, as before.
Every GPU must be visible to every process (instances pick GPUs with --device cuda:N, not
CUDA_VISIBLE_DEVICES).
"""
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.connectors.layout import RankPair

_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device: where the handle is opened


def open_peer_cache(info: bytes, device: torch.device) -> torch.Tensor:
    """The peer's exported KV cache, mapped into `device`'s context when that GPU has peer access
    to the one holding it (the tensor then says `device`; its loads and stores cross the link),
    else opened on its own GPU."""
    args = list(pickle.loads(info))
    owner = args[_DEVICE_ARG]
    if owner != device.index and torch.cuda.can_device_access_peer(device.index, owner):
        args[_DEVICE_ARG] = device.index
    return rebuild_cuda_tensor(*args)


class IpcTransport:
    name = "ipc"

    def __init__(self, kv_cache: torch.Tensor):
        if not kv_cache.is_cuda:
            raise ValueError("the ipc KV transport needs the KV cache on a GPU; use 'tcp' on CPU")
        self.kv_cache = kv_cache
        self.peers: dict[str, torch.Tensor] = {}
        self.local_stream = torch.cuda.Stream(kv_cache.device)
        self.remote_streams: dict[str, torch.cuda.Stream] = {}  # per peer: its writes, on the peer's tensor's GPU

    def local_info(self) -> bytes:
        _, args = reduce_tensor(self.kv_cache)
        return pickle.dumps(args)

    def attach(self, peer: str, info: bytes) -> None:
        if not info:
            raise ValueError(f"the peer at {peer} did not export its KV cache for ipc (is it using tcp?)")
        remote = open_peer_cache(info, self.kv_cache.device)
        self.peers[peer] = remote
        self.remote_streams[peer] = torch.cuda.Stream(remote.device)

    @staticmethod
    def _index(blocks: list[int], device) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=device)

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int],
             pair: RankPair) -> None:
        remote, n = self.peers[peer], pair.num_heads
        dst = self.kv_cache[:, :, :, :, pair.dst_head:pair.dst_head + n]
        if remote.device == self.kv_cache.device:  # mapped here: gather over the link, scatter locally
            with torch.cuda.device(remote.device), torch.cuda.stream(self.local_stream):
                data = remote[:, :, self._index(remote_blocks, remote.device), :, pair.src_head:pair.src_head + n]
                dst[:, :, self._index(local_blocks, remote.device)] = data
        else:
            with torch.cuda.device(remote.device), torch.cuda.stream(self.remote_streams[peer]):
                data = remote[:, :, self._index(remote_blocks, remote.device), :, pair.src_head:pair.src_head + n]
            with torch.cuda.device(self.kv_cache.device), torch.cuda.stream(self.local_stream):
                self.local_stream.wait_stream(self.remote_streams[peer])
                dst[:, :, self._index(local_blocks, self.kv_cache.device)] = data.to(self.kv_cache.device)
        self.local_stream.synchronize()

    def stage_layer(self, layer: int, local_blocks: list[int], pair: RankPair):
        """Engine thread: an event after the layer's KV store, so the copy waits for it, not the model."""
        event = torch.cuda.Event()
        event.record()
        return event, layer, local_blocks

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int],
                    pair: RankPair) -> None:
        event, layer, local_blocks = staged
        remote, stream, n = self.peers[peer], self.remote_streams[peer], pair.num_heads
        dst = remote[:, layer, :, :, pair.dst_head:pair.dst_head + n]
        if remote.device == self.kv_cache.device:  # mapped here: gather locally, scatter over the link
            with torch.cuda.device(remote.device), torch.cuda.stream(stream):
                stream.wait_event(event)
                data = self.kv_cache[:, layer, self._index(local_blocks, remote.device), :,
                                     pair.src_head:pair.src_head + n]
                dst[:, self._index(remote_blocks, remote.device)] = data
            return
        with torch.cuda.device(self.kv_cache.device), torch.cuda.stream(self.local_stream):
            self.local_stream.wait_event(event)
            data = self.kv_cache[:, layer, self._index(local_blocks, self.kv_cache.device), :,
                                 pair.src_head:pair.src_head + n]
        with torch.cuda.device(remote.device), torch.cuda.stream(stream):
            stream.wait_stream(self.local_stream)
            dst[:, self._index(remote_blocks, remote.device)] = data.to(remote.device, non_blocking=True)
        # data's memory goes back to the local stream's pool when this returns, while the peer's
        # stream may still be reading it: the local stream's next work (which may reuse it) waits
        with torch.cuda.device(self.kv_cache.device):
            self.local_stream.wait_stream(stream)

    def flush(self, peer: str) -> None:
        self.remote_streams[peer].synchronize()

    def close(self) -> None:
        self.peers.clear()

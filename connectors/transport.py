"""Transports: how block data moves once two KV agents have shaken hands.

A transport registers the local KV cache (`local_info()` is what the peer needs to
reach it, sent in the handshake), attaches to a peer's, and moves blocks:
`read` pulls a peer's blocks into ours (read mode, blocking, agent client thread);
`write_layer` pushes one layer of our blocks into a peer's (write mode; may be
asynchronous) and `flush` returns once every push so far has landed.
The cache is [2, layers, blocks, block_size, kv_heads, head_dim]; blocks are dim 2.
"""
import torch

from tandem.connectors.protocol import WriteBlocks
from tandem.connectors.staging import gather_blocks


class TcpTransport:
    """Host-staged over the agents' ZMQ sockets: works anywhere (CI, across nodes)."""

    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, agent):
        self.kv_cache, self.agent = kv_cache, agent

    def local_info(self) -> bytes:
        return b""

    def attach(self, peer: str, info: bytes) -> None:
        pass

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int]) -> None:
        self.agent.read_blocks(peer, request_id, remote_blocks, local_blocks)

    def stage_layer(self, layer: int, local_blocks: list[int]):
        """Engine thread, right after the layer's KV was stored: capture what to send."""
        return gather_blocks(self.kv_cache, local_blocks, layer)

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int]) -> None:
        self.agent.send(peer, WriteBlocks(transfer_id, layer, remote_blocks), staged)

    def flush(self, peer: str) -> None:
        pass  # ZMQ delivers in order: the completion message follows the data

    def close(self) -> None:
        pass


def make_transport(name: str, kv_cache: torch.Tensor, agent):
    if name == "tcp":
        return TcpTransport(kv_cache, agent)
    if name == "ipc":
        from tandem.connectors.ipc import IpcTransport
        return IpcTransport(kv_cache)
    if name == "mori":
        from tandem.connectors.mori import MoriTransport
        return MoriTransport(kv_cache, agent)
    if name == "nixl":
        from tandem.connectors.nixl import NixlTransport
        return NixlTransport(kv_cache, f"tandem-{agent.engine_id}", agent.timeout_ms / 1000)
    raise ValueError(f"unknown KV transport {name!r}; expected tcp, ipc, mori or nixl")

"""Transports: how one rank's block data moves once two ranks' agents have shaken hands.

A transport registers its rank's KV cache (`local_info()` is what the peer rank needs to reach
it, sent in the data handshake), attaches to a peer rank's, and moves heads of blocks, as a
RankPair says (pair.num_heads heads from head pair.src_head of the prefill rank to head
pair.dst_head of the decode rank):
`read` pulls a peer's blocks into ours (read mode, blocking, agent client thread);
`stage_layer` (engine thread, right after the layer's KV was stored) captures what to push and
`write_layer` pushes it into a peer's blocks (write mode; may be asynchronous); `flush` returns
once every push so far has landed.
The cache is [2, layers, blocks, block_size, kv_heads, head_dim]; blocks are dim 2.
"""
import torch

from tandem.connectors.layout import RankPair
from tandem.connectors.protocol import BlocksData, ReadBlocks, WriteBlocks
from tandem.connectors.staging import gather_blocks, scatter_blocks


class TcpTransport:
    """Host-staged over the rank agents' ZMQ sockets: works anywhere (CI, across nodes)."""

    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, agent):
        self.kv_cache, self.agent = kv_cache, agent

    def local_info(self) -> bytes:
        return b""

    def attach(self, peer: str, info: bytes) -> None:
        pass

    def read(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int],
             pair: RankPair) -> None:
        from tandem.connectors.agent import TransferError

        reply, data = self.agent.request(peer, ReadBlocks(request_id, remote_blocks, pair.src_head, pair.num_heads))
        if not isinstance(reply, BlocksData) or reply.error or data is None:
            raise TransferError(f"KV read of {request_id} from {peer} failed: {getattr(reply, 'error', reply)}")
        scatter_blocks(self.kv_cache, local_blocks, data, -1, pair.dst_head, pair.num_heads)

    def stage_layer(self, layer: int, local_blocks: list[int], pair: RankPair):
        return gather_blocks(self.kv_cache, local_blocks, layer, pair.src_head, pair.num_heads)

    def write_layer(self, peer: str, transfer_id: str, layer: int, staged, remote_blocks: list[int],
                    pair: RankPair) -> None:
        self.agent.send(peer, WriteBlocks(transfer_id, layer, remote_blocks, pair.dst_head, pair.num_heads), staged)

    def flush(self, peer: str) -> None:
        pass  # ZMQ delivers in order: the completion message follows the data

    def close(self) -> None:
        pass


# Transports whose prefill rank writes the decode rank's KV memory itself (write mode): a push that
# arrives after its transfer ended cannot be dropped on arrival as tcp's is, so the decode side keeps
# such a transfer's blocks until the prefill says its pushes are over (or a further timeout).
_PEER_WRITES_MEMORY = frozenset({"ipc", "mori", "nixl"})


def peer_writes_memory(name: str) -> bool:
    """Whether transport `name` lets the prefill write the decode's KV cache directly."""
    return name in _PEER_WRITES_MEMORY


def make_transport(name: str, kv_cache: torch.Tensor, agent):
    """agent: the rank's data KVAgent (tcp and mori talk through it; its name, unique per engine
    and rank, names the NIXL agent and MoRI's IOEngine; its timeout bounds NIXL's waits)."""
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
        return NixlTransport(kv_cache, agent.name, agent.timeout_ms / 1000)
    raise ValueError(f"unknown KV transport {name!r}; expected tcp, ipc, mori or nixl")

"""Messages of the KV connector (ZMQ frames, msgpack via msgspec) and the per-step transfer
work that travels with a scheduled step to every rank.

Control messages go between the scheduler sides of two instances, and from a rank to its own
scheduler side. Data messages go between ranks (each rank runs a data agent). Block data
travels as raw bytes of a [2, layers, blocks, block_size, heads, head_dim] slice.
"""
from dataclasses import dataclass, field

import msgspec

from tandem.connectors.layout import KVLayout, RankPair


# ---- control: scheduler side <-> scheduler side --------------------------------------------

class Hello(msgspec.Struct, tag=True):
    """Handshake, once per instance pair (or per rank pair on the data path, with rank set)."""

    engine_id: str
    layout: KVLayout
    transport: str = "tcp"
    rank: int = -1


class HelloReply(msgspec.Struct, tag=True):
    engine_id: str
    layout: KVLayout | None = None
    error: str | None = None
    transport: str = "tcp"
    rank_addresses: list[str] = []  # control: each rank's data agent (the rank -> KV-head map is the layout's)
    transport_info: bytes = b""  # data: what the transport needs to reach this rank's KV cache


class DecodeBlocks(msgspec.Struct, tag=True):
    """Write mode, decode -> prefill: where to write (one id per prompt block; -1: skip, cached
    on the decode side); empty: nothing is needed."""

    transfer_id: str
    engine_id: str
    block_ids: list[int]
    layout: KVLayout | None = None
    rank_addresses: list[str] = []
    reply_to: str = ""  # decode's connector: where a prefill that will never push says so (TransferDone)


class FreeBlocks(msgspec.Struct, tag=True):
    """Read mode, decode -> prefill: done reading (or gave up); free the request's blocks."""

    request_id: str


class TransferDone(msgspec.Struct, tag=True):
    """Write mode, prefill -> decode: the transfer ended with nothing (more) pushed (error)."""

    transfer_id: str
    error: str | None = None


class FirstToken(msgspec.Struct, tag=True):
    """Write mode, prefill -> decode: the prefill finished the prompt and sampled the first output
    token (logprobs: [token_ids, logprobs, rank] when the request asked for them)."""

    transfer_id: str
    token_id: int
    logprobs: list | None = None


class PeerGone(msgspec.Struct, tag=True):
    """Router -> prefill: the router dropped the instance whose KV connector is at `peer`
    (host:port; it stopped pinging): end the transfers with it and free their blocks now."""

    peer: str


class AbortTransfer(msgspec.Struct, tag=True):
    """Write mode, decode -> prefill: the decode request is gone; stop pushing."""

    transfer_id: str


class RankDone(msgspec.Struct, tag=True):
    """Rank -> its own scheduler side: `pair` finished its part of a transfer (request_id is
    local; transfer_id when forwarded from a peer's WriteDone)."""

    pair: RankPair
    request_id: str | None = None
    transfer_id: str | None = None
    error: str | None = None


# ---- data: rank <-> rank -------------------------------------------------------------------

class ReadBlocks(msgspec.Struct, tag=True):
    """Read mode: a decode rank asks a prefill rank for heads of these blocks (all layers)."""

    request_id: str
    block_ids: list[int]
    head: int
    num_heads: int


class BlocksData(msgspec.Struct, tag=True):
    """Reply to ReadBlocks; a payload frame follows unless error is set."""

    request_id: str
    error: str | None = None


class WriteBlocks(msgspec.Struct, tag=True):
    """Write mode: one layer of some blocks' heads (dst side offsets); payload follows."""

    transfer_id: str
    layer: int
    block_ids: list[int]
    head: int
    num_heads: int


class WriteDone(msgspec.Struct, tag=True):
    """Write mode, prefill rank -> decode rank, after its data: the pair's pushes are over."""

    transfer_id: str
    pair: RankPair
    error: str | None = None


Message = (Hello | HelloReply | DecodeBlocks | FreeBlocks | TransferDone | FirstToken | PeerGone | AbortTransfer
           | RankDone | ReadBlocks | BlocksData | WriteBlocks | WriteDone)
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)


# ---- the step's transfer work, for every rank ------------------------------------------------

@dataclass
class ReadOp:
    """Decode, read mode: the ranks pull a request's prompt blocks from the prefill's ranks."""

    request_id: str
    remote_request_id: str
    remote_blocks: list[int]
    local_blocks: list[int]
    pairs: list[RankPair]
    peer_ranks: list[str]


@dataclass
class PushOp:
    """Prefill, write mode: push these blocks' KV. layerwise: blocks of this step's chunk, each
    layer right after the forward pass stored it; else blocks computed by earlier steps (before
    decode's block ids came), every layer at once when the step starts. final: this push ends
    the prompt, so the pairs report once it has landed."""

    request_id: str
    transfer_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    pairs: list[RankPair]
    peer_ranks: list[str]
    final: bool
    layerwise: bool = True


@dataclass
class FinishOp:
    """Prefill, write mode: end the pairs' pushes now (aborted or failed), telling decode why."""

    request_id: str
    transfer_id: str
    pairs: list[RankPair]
    peer_ranks: list[str]
    error: str


@dataclass
class KVStepMeta:
    """What a step transfers, decided by the scheduler side; each rank does its own pairs."""

    notify: str  # the scheduler side's control address: ranks report RankDone there
    reads: list[ReadOp] = field(default_factory=list)
    pushes: list[PushOp] = field(default_factory=list)
    finishes: list[FinishOp] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # write transfers over: drop their late data

    def __bool__(self) -> bool:
        return bool(self.reads or self.pushes or self.finishes or self.closed)

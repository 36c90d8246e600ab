"""Messages between KV agents of two instances (ZMQ frames, msgpack via msgspec).

Every message is [header(msgpack), payload bytes?]. Block data travels as raw bytes
of a [2, layers, blocks, block_size, kv_heads, head_dim] slice of the KV cache.
"""
import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1
    tp_rank: int = 0

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why two instances cannot exchange KV blocks, or None if they can."""
        diffs = [f"{f}: {getattr(self, f)} vs {getattr(other, f)}" for f in self.__struct_fields__
                 if getattr(self, f) != getattr(other, f)]
        return "KV layouts differ (" + ", ".join(diffs) + ")" if diffs else None


class Handshake(msgspec.Struct, tag=True):
    engine_id: str
    layout: KVLayout
    transport: str = "tcp"


class HandshakeReply(msgspec.Struct, tag=True):
    engine_id: str
    layout: KVLayout | None = None
    error: str | None = None
    transport: str = "tcp"
    transport_info: bytes = b""  # what the transport needs to reach this instance's KV cache


class ReadBlocks(msgspec.Struct, tag=True):
    """Read mode: decode asks prefill for these blocks (all layers)."""

    request_id: str
    block_ids: list[int]


class BlocksData(msgspec.Struct, tag=True):
    """Reply to ReadBlocks; payload frame follows unless error is set."""

    request_id: str
    error: str | None = None


class WriteBlocks(msgspec.Struct, tag=True):
    """Write mode: prefill pushes one layer (or all: layer = -1) of some blocks; payload follows."""

    transfer_id: str
    layer: int
    block_ids: list[int]


class TransferDone(msgspec.Struct, tag=True):
    """Write mode: every block of transfer_id has been written (or the push failed)."""

    transfer_id: str
    error: str | None = None


class DecodeBlocks(msgspec.Struct, tag=True):
    """Write mode: decode tells prefill where to write (one id per prompt block; -1 = skip,
    already cached on the decode side)."""

    transfer_id: str
    engine_id: str
    block_ids: list[int]


class FreeBlocks(msgspec.Struct, tag=True):
    """Read mode: decode is done reading (or gave up); prefill may free the request's blocks."""

    request_id: str


Message = Handshake | HandshakeReply | ReadBlocks | BlocksData | WriteBlocks | TransferDone | DecodeBlocks | FreeBlocks
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)

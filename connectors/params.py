"""kv_transfer_params: the one typed structure the router, the API server and the KV connector
share (what a PD request carries between instances).

Read mode: the router sends prefill {do_remote_decode, remote_* = the decode that will read};
prefill answers {do_remote_prefill, remote_block_ids, remote_request_id, remote_* = itself};
the router forwards that to decode. Write mode: both get {mode: "write", transfer_id, remote_* =
the other side} at once. remote_host:remote_port is the peer's KV connector (scheduler side).

The prefill computes the whole prompt and samples the first output token, exactly as a collocated
server would; the decode receives the KV of every prompt token and emits that token as its first
output (read mode: in first_token_*, from prefill's answer; write mode: in a FirstToken message),
so its first step is the decode of that token, as a collocated server's second step is.
"""
from typing import Literal

import msgspec


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    do_remote_decode: bool = False  # this instance prefills; a decode instance takes the KV
    do_remote_prefill: bool = False  # this instance decodes; the prompt KV comes from a prefill
    mode: Literal["read", "write"] = "read"
    transfer_id: str | None = None  # write mode: names the transfer on both sides
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_notify_port: int | None = None
    remote_block_ids: list[int] | None = None  # read mode: the prefill's blocks holding the prompt
    remote_request_id: str | None = None  # read mode: the prefill's request id
    first_token_id: int | None = None  # read mode, prefill's answer: the first output token it sampled
    first_token_logprobs: list | None = None  # and its logprobs when asked: [token_ids, logprobs, rank]

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill are exclusive")
        if self.mode == "write" and (self.do_remote_decode or self.do_remote_prefill) and not self.transfer_id:
            raise ValueError("transfer_id is required in write mode")
        if self.do_remote_prefill or (self.do_remote_decode and self.mode == "write"):
            for name in ("remote_host", "remote_port"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name} is required")
        if self.do_remote_prefill and self.mode == "read":
            for name in ("remote_block_ids", "remote_request_id"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name} is required in read mode")
        if self.remote_port is not None and not 0 < self.remote_port < 65536:
            raise ValueError(f"remote_port {self.remote_port} is not a port number")

    @property
    def peer(self) -> str | None:
        """host:port of the other instance's KV connector, when known."""
        return f"{self.remote_host}:{self.remote_port}" if self.remote_host and self.remote_port else None

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


def parse_kv_transfer_params(obj) -> KVTransferParams | None:
    """Validate a client's (or a peer's) kv_transfer_params. Raises ValueError naming the field."""
    if obj is None or isinstance(obj, KVTransferParams):
        return obj
    try:
        return msgspec.convert(obj, KVTransferParams)
    except msgspec.ValidationError as e:
        msg = str(e).replace("`$.", "`kv_transfer_params.").replace("`$`", "`kv_transfer_params`")
        raise ValueError(f"invalid kv_transfer_params: {msg}") from None

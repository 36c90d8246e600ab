"""Registry messages: what an instance tells the router over ZMQ.

An instance (prefill, decode or collocated API server) pushes a msgpack-encoded
`RegisterMessage` every ping interval to the router's registry socket (ZMQ PUSH
-> PULL), and one `UnregisterMessage` on clean shutdown. The first field of the
encoded map is `"type"`: `"register"` or `"unregister"`. The instance side lives here in
server/ (server/registration.py sends them); router/registry.py imports it to decode them.
"""
from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "collocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "collocated")


class LoadReport(msgspec.Struct, kw_only=True):
    """An instance's load at the time of its ping."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1


class InstanceInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What does not change while an instance lives: who it is and where to reach it.

    `http_address` is the OpenAI API base, e.g. "http://10.0.0.5:8100" (no /v1).
    `engine_id`, `kv_host`, `kv_handshake_port`, `kv_notify_port` are the KV
    connector's identity and ZMQ ports; the router passes them to the peer in
    write mode. Collocated instances leave them at their defaults.
    """

    instance_id: str
    role: Role
    http_address: str
    engine_id: str = ""
    kv_host: str = ""
    kv_handshake_port: int = 0
    kv_notify_port: int = 0
    tp_size: int = 1
    dp_size: int = 1


class RegisterMessage(InstanceInfo, kw_only=True, frozen=True, tag="register", tag_field="type"):
    """A ping: the instance's static info plus its current load."""

    load: LoadReport = msgspec.field(default_factory=LoadReport)

    def static_info(self) -> InstanceInfo:
        return InstanceInfo(**{f: getattr(self, f) for f in InstanceInfo.__struct_fields__})


class UnregisterMessage(msgspec.Struct, frozen=True, tag="unregister", tag_field="type"):
    instance_id: str


RegistryMessage = RegisterMessage | UnregisterMessage


def encode_message(msg: RegistryMessage) -> bytes:
    return msgspec.msgpack.encode(msg)


_decoder = msgspec.msgpack.Decoder(RegistryMessage)


def decode_message(data: bytes) -> RegistryMessage:
    """Raises msgspec.ValidationError / DecodeError on a malformed frame."""
    return _decoder.decode(data)

"""Topology specs for benchmarks.goodput: what deployment to start.

On the command line (`--topology`, repeatable):
    colloc:N[:direct][:gpus=G][:name=X]            N collocated instances behind the router
                                                   (direct: one instance, no router)
    pd:XpYd[:write|read][:tcp|ipc|mori][:gpus=G][:name=X]   X prefill + Y decode instances behind
                                                   the router (default write mode, tcp)
From a JSON file (`--topology-file`): a list of objects with the same fields as `Topology`
(kind, instances, prefill, decode, kv_mode, transport, gpus, direct, name, server_args,
prefill_args, decode_args; the *_args lists of extra `server` flags).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

KV_MODES = ("write", "read")
TRANSPORTS = ("tcp", "ipc", "mori")


@dataclass(frozen=True)
class Topology:
    kind: str  # "colloc" | "pd"
    instances: int = 1  # colloc
    prefill: int = 1  # pd
    decode: int = 1  # pd
    kv_mode: str = "write"
    transport: str = "tcp"
    gpus: int = 1  # GPUs per instance (--device cuda:N and the next ones); > 1 adds --tensor-parallel-size G by default
    direct: bool = False  # colloc with one instance: clients talk to it, no router
    name: str = ""
    server_args: tuple[str, ...] = ()  # extra `server` flags for every instance of this topology
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("colloc", "pd"):
            raise ValueError(f"topology kind must be colloc or pd, got {self.kind!r}")
        if min(self.instances, self.prefill, self.decode, self.gpus) < 1:
            raise ValueError(f"instance and GPU counts must be >= 1: {self}")
        if self.kv_mode not in KV_MODES or self.transport not in TRANSPORTS:
            raise ValueError(f"kv_mode must be one of {KV_MODES} and transport one of {TRANSPORTS}: {self}")
        if self.direct and (self.kind != "colloc" or self.instances != 1):
            raise ValueError("direct applies to colloc:1 only (several instances need the router)")
        for f in ("server_args", "prefill_args", "decode_args"):
            value = getattr(self, f)
            object.__setattr__(self, f, tuple(shlex.split(value) if isinstance(value, str) else value))
        if not self.name:
            name = (f"colloc{self.instances}" + ("-direct" if self.direct else "") if self.kind == "colloc"
                    else f"pd{self.prefill}p{self.decode}d-{self.kv_mode}-{self.transport}")
            object.__setattr__(self, "name", name + (f"-g{self.gpus}" if self.gpus > 1 else ""))
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ValueError(f"topology name {self.name!r}: letters, digits, '.', '_' and '-' only (it names files)")

    @property
    def num_instances(self) -> int:
        return self.instances if self.kind == "colloc" else self.prefill + self.decode

    @classmethod
    def parse(cls, spec: str) -> "Topology":
        """One --topology value (see the module docstring)."""
        kind, *parts = spec.split(":")
        fields: dict = {"kind": kind}
        for i, part in enumerate(parts):
            if "=" in part:
                key, value = part.split("=", 1)
                if key not in ("gpus", "name"):
                    raise ValueError(f"{spec}: unknown option {key!r} (gpus=G, name=X)")
                fields[key] = int(value) if key == "gpus" else value
            elif i == 0 and kind == "colloc" and part.isdigit():
                fields["instances"] = int(part)
            elif i == 0 and kind == "pd" and (m := re.fullmatch(r"(\d+)p(\d+)d", part)):
                fields["prefill"], fields["decode"] = int(m[1]), int(m[2])
            elif kind == "colloc" and part == "direct":
                fields["direct"] = True
            elif kind == "pd" and part in KV_MODES:
                fields["kv_mode"] = part
            elif kind == "pd" and part in TRANSPORTS:
                fields["transport"] = part
            else:
                raise ValueError(f"cannot read topology {spec!r} at {part!r}; expected colloc:N[:direct] or "
                                 "pd:XpYd[:write|read][:tcp|ipc|mori], then optional :gpus=G :name=X")
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> list["Topology"]:
        items = json.loads(Path(path).read_text())
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of topologies")
        known = {f.name for f in dataclasses.fields(cls)}
        for item in items:
            if unknown := set(item) - known:
                raise ValueError(f"{path}: unknown topology fields {sorted(unknown)}; known: {sorted(known)}")
        return [cls(**item) for item in items]

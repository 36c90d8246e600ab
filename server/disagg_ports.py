"""The ports of PD instances and of a `--role disagg` tree, fixed before any process starts:
derived from --base-port (disagg) or --port / --kv-port (one instance), or given as lists;
checked free and printed. Random ports only where a flag says 0.

One instance's block, in order: HTTP, KV handshake (the connector's scheduler side), one KV data
port per TP rank (the connector's worker side, rank r at KV+1+r), then with TP > 1 the
torch.distributed rendezvous (--master-port). gloo/NCCL's own rank-to-rank listeners are not
among them: those libraries take ephemeral ports and have no setting for it.
"""
import argparse
import random
from dataclasses import dataclass

from tandem.server.lifecycle import PortInUseError, check_port_free

DEFAULT_BASE_PORT = 30001


@dataclass(frozen=True)
class InstancePorts:
    http: int
    kv: int  # the KV handshake (0: a free one, then kv_data is 0 too)
    kv_data: int  # rank r's KV data port is kv_data + r (0: free ports)
    tp: int = 1
    master: int | None = None  # the torch.distributed rendezvous (TP > 1)

    def describe(self) -> str:
        data = "free" if not self.kv_data else (str(self.kv_data) if self.tp == 1
                                                else f"{self.kv_data}-{self.kv_data + self.tp - 1}")
        out = f"http={self.http} kv={self.kv or 'free'} kv-data={data}"
        return out + (f" master={self.master}" if self.master is not None else "")

    def fixed(self) -> list[tuple[int, str]]:
        """(port, what) of every port this instance's processes listen on that is known now."""
        out = [(self.http, "HTTP"), (self.kv, "KV handshake")]
        out += [(self.kv_data + r, f"rank {r} KV data") for r in range(self.tp)] if self.kv_data else []
        out += [(self.master, "torch.distributed rendezvous")] if self.master is not None else []
        return [(p, what) for p, what in out if p]


def instance_ports(http: int, kv: int, tp: int, master: int | None = None) -> InstancePorts:
    """The block after the KV handshake port: KV data per rank, then the rendezvous (TP > 1;
    `master` overrides it). kv=0: free KV ports."""
    if tp > 1 and master is None:
        master = (kv or http + 1) + 1 + tp
    return InstancePorts(http, kv, kv + 1 if kv else 0, tp, master if tp > 1 else None)


def block_size(tp: int) -> int:
    """Ports one instance of this TP size takes from --base-port."""
    return 2 + tp + (1 if tp > 1 else 0)


@dataclass(frozen=True)
class DisaggPorts:
    registry: int
    prefill: list[InstancePorts]
    decode: list[InstancePorts]

    def describe(self, router_port: int) -> str:
        parts = [f"router http={router_port} registry={self.registry}"]
        for role, ports in (("prefill", self.prefill), ("decode", self.decode)):
            parts += [f"{role}-{i} {p.describe()}" for i, p in enumerate(ports)]
        return "; ".join(parts)


def add_disagg_port_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--base-port", type=int, default=None,
                       help=f"disagg: registry = BASE, then one block per instance (prefills, then decodes): "
                            f"HTTP, KV handshake, KV data per TP rank, and with TP > 1 the torch.distributed "
                            f"rendezvous; e.g. TP 2: prefill-0 = BASE+1..BASE+5 (default {DEFAULT_BASE_PORT}; "
                            f"0: a free base chosen at random)")
    group.add_argument("--prefill-ports", default=None,
                       help="disagg: HTTP[:KV] port per prefill instance, e.g. 8100:8101,8110:8111 (KV: HTTP+1; "
                            "the KV data ports and the TP rendezvous follow KV)")
    group.add_argument("--decode-ports", default=None,
                       help="disagg: HTTP[:KV] port per decode instance, e.g. 8200:8201 (KV: HTTP+1; the KV data "
                            "ports and the TP rendezvous follow KV)")


def _parse_list(text: str, count: int, tp: int, flag: str) -> list[InstancePorts]:
    out = []
    for item in text.split(","):
        http, _, kv = item.strip().partition(":")
        try:
            out.append(instance_ports(int(http), int(kv) if kv else int(http) + 1, tp))
        except ValueError:
            raise SystemExit(f"server: {flag}: {item!r} is not HTTP[:KV] (port numbers)") from None
    if len(out) != count:
        raise SystemExit(f"server: {flag} lists {len(out)} instance(s), expected {count}")
    return out


def _port_free(port: int) -> bool:
    try:
        check_port_free("0.0.0.0", port, "", "")
        return True
    except PortInUseError:
        return False


_handed_out: set[int] = set()  # blocks this process gave out, bound by now or not yet


def free_port_block(size: int) -> int:
    """The first of `size` consecutive ports that are all free now, below Linux's ephemeral range
    (32768+, where an outgoing connection could take one before its process binds it), overlapping
    no block this process handed out before (processes bind their blocks one port after another,
    so two overlapping blocks collide while both start). For --base-port 0 and for harnesses that
    start servers (benchmarks/goodput). RuntimeError when none is found."""
    for _ in range(200):
        block = range(base := random.randint(10000, 32767 - size), base + size)
        if _handed_out.isdisjoint(block) and all(_port_free(p) for p in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no {size} consecutive free ports found below 32768")


def plan_ports(args: argparse.Namespace, tp: dict[str, int]) -> DisaggPorts:
    """The tree's ports from args (--base-port, --registry-port, --prefill-ports, --decode-ports)
    for instances of TP sizes tp["prefill"], tp["decode"]."""
    counts = {"prefill": args.num_prefill, "decode": args.num_decode}
    base = DEFAULT_BASE_PORT if args.base_port is None else args.base_port
    if base == 0:
        try:
            base = free_port_block(1 + sum(counts[r] * block_size(tp[r]) for r in counts))
        except RuntimeError as e:
            raise SystemExit(f"server: --base-port 0: {e}; give --base-port") from None
    lists = {"prefill": args.prefill_ports, "decode": args.decode_ports}
    out, nxt = {}, base + 1
    for role in ("prefill", "decode"):
        if lists[role]:
            out[role] = _parse_list(lists[role], counts[role], tp[role], f"--{role}-ports")
            continue
        out[role] = [instance_ports(nxt + i * block_size(tp[role]), nxt + i * block_size(tp[role]) + 1, tp[role])
                     for i in range(counts[role])]
        nxt += counts[role] * block_size(tp[role])
    return DisaggPorts(args.registry_port or base, out["prefill"], out["decode"])


def check_instance_ports(ports: InstancePorts, who: str, flag: str, seen: set[int], http_bound: bool = False) -> None:
    """PortInUseError naming the first of the instance's ports that is taken (SystemExit when one
    is given twice); adds them to `seen`. http_bound: the caller holds the HTTP port already."""
    for port, what in ports.fixed():
        if port in seen:
            raise SystemExit(f"server: port {port} is given twice ({who} {what}); fix the port flags")
        seen.add(port)
        if not (http_bound and what == "HTTP"):
            check_port_free("0.0.0.0", port, f"{who}'s {what}", flag)


def check_ports_free(ports: DisaggPorts, host: str, router_port: int) -> None:
    """PortInUseError naming the first taken port (nothing has started yet)."""
    check_port_free(host, router_port, "the router's HTTP API", "--port")
    check_port_free("0.0.0.0", ports.registry, "the router registry", "--registry-port / --base-port")
    seen = {router_port, ports.registry}
    for role, items in (("prefill", ports.prefill), ("decode", ports.decode)):
        for i, p in enumerate(items):
            check_instance_ports(p, f"{role}-{i}", f"--{role}-ports / --base-port", seen)

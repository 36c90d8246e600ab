"""The ports of a `--role disagg` tree, fixed before any child starts: derived from --base-port
(or given as lists), checked free, and printed. Random ports only with --base-port 0."""
import argparse
from dataclasses import dataclass

from tandem.router.lifecycle import check_port_free

DEFAULT_BASE_PORT = 30001


@dataclass(frozen=True)
class InstancePorts:
    http: int
    kv: int


@dataclass(frozen=True)
class DisaggPorts:
    registry: int
    prefill: list[InstancePorts]
    decode: list[InstancePorts]

    def describe(self, router_port: int) -> str:
        parts = [f"router http={router_port} registry={self.registry}"]
        for role, ports in (("prefill", self.prefill), ("decode", self.decode)):
            parts += [f"{role}-{i} http={p.http} kv={p.kv}" for i, p in enumerate(ports)]
        return "; ".join(parts)


def add_disagg_port_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--base-port", type=int, default=None,
                       help=f"disagg: registry = BASE, prefill i = BASE+1+2i (HTTP) and +1 (KV), then decode "
                            f"likewise (default {DEFAULT_BASE_PORT}; 0: free ports chosen at random)")
    group.add_argument("--prefill-ports", default=None,
                       help="disagg: HTTP[:KV] port per prefill instance, e.g. 8100:8101,8102:8103 (KV: HTTP+1)")
    group.add_argument("--decode-ports", default=None,
                       help="disagg: HTTP[:KV] port per decode instance, e.g. 8200:8201 (KV: HTTP+1)")


def _parse_list(text: str, count: int, flag: str) -> list[InstancePorts]:
    out = []
    for item in text.split(","):
        http, _, kv = item.strip().partition(":")
        try:
            out.append(InstancePorts(int(http), int(kv) if kv else int(http) + 1))
        except ValueError:
            raise SystemExit(f"server: {flag}: {item!r} is not HTTP[:KV] (port numbers)") from None
    if len(out) != count:
        raise SystemExit(f"server: {flag} lists {len(out)} instance(s), expected {count}")
    return out


def plan_ports(args: argparse.Namespace, free_port) -> DisaggPorts:
    """The tree's ports from args (--base-port, --registry-port, --prefill-ports, --decode-ports);
    `free_port()` is used only with --base-port 0."""
    base = DEFAULT_BASE_PORT if args.base_port is None else args.base_port

    def derived(offset: int, count: int) -> list[InstancePorts]:
        if base == 0:
            return [InstancePorts(free_port(), free_port()) for _ in range(count)]
        return [InstancePorts(base + offset + 2 * i, base + offset + 2 * i + 1) for i in range(count)]

    registry = args.registry_port or (free_port() if base == 0 else base)
    prefill = (_parse_list(args.prefill_ports, args.num_prefill, "--prefill-ports") if args.prefill_ports
               else derived(1, args.num_prefill))
    decode = (_parse_list(args.decode_ports, args.num_decode, "--decode-ports") if args.decode_ports
              else derived(1 + 2 * args.num_prefill, args.num_decode))
    return DisaggPorts(registry, prefill, decode)


def check_ports_free(ports: DisaggPorts, host: str, router_port: int) -> None:
    """PortInUseError naming the first taken port (nothing has started yet)."""
    check_port_free(host, router_port, "the router's HTTP API", "--port")
    check_port_free("0.0.0.0", ports.registry, "the router registry", "--registry-port / --base-port")
    seen = {router_port, ports.registry}
    for role, items in (("prefill", ports.prefill), ("decode", ports.decode)):
        for i, p in enumerate(items):
            for port, what in ((p.http, "HTTP"), (p.kv, "KV handshake")):
                if port in seen:
                    raise SystemExit(f"server: port {port} is given twice ({role}-{i} {what}); fix the port flags")
                seen.add(port)
                check_port_free("0.0.0.0", port, f"{role}-{i}'s {what}", f"--{role}-ports / --base-port")

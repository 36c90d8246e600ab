"""RouterConfig: the router's settings, built once from CLI flags and passed down."""
import argparse
from dataclasses import dataclass, fields
from typing import Literal

RoutingPolicyName = Literal["round_robin", "least_load"]
KVMode = Literal["write", "read"]


@dataclass(frozen=True)
class RouterConfig:
    """Settings of one router process.

    kv_mode: "write" (prefill pushes KV to decode; P and D are called at once) or
    "read" (decode pulls KV from prefill; P is called first, then D).
    instance_timeout_s: an instance silent this long is dropped from the registry.
    request_timeout_s: the longest an upstream may stay silent (no bytes) before
    the request fails with 504.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    registry_host: str = "0.0.0.0"
    registry_port: int = 30001  # ZMQ PULL socket instances push their pings to (0: any free port)
    routing_policy: RoutingPolicyName = "round_robin"
    kv_mode: KVMode = "write"
    ping_interval_s: float = 1.0
    instance_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_check_timeout_s: float = 2.0
    api_key: str | None = None
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0  # SIGTERM: open requests get this long to finish
    disable_docs: bool = False

    def __post_init__(self) -> None:
        if self.routing_policy not in ("round_robin", "least_load"):
            raise ValueError(f"routing_policy must be round_robin or least_load, got {self.routing_policy!r}")
        if self.kv_mode not in ("write", "read"):
            raise ValueError(f"kv_mode must be write or read, got {self.kv_mode!r}")
        if self.instance_timeout_s <= self.ping_interval_s:
            raise ValueError(
                f"instance_timeout_s ({self.instance_timeout_s}) must exceed ping_interval_s "
                f"({self.ping_interval_s}), or every instance is dropped between two pings"
            )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "RouterConfig":
        """Build from a namespace parsed with `add_router_args`; absent names keep their defaults."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if getattr(ns, f.name, None) is not None}
        return cls(**values)


def _add(group: argparse._ArgumentGroup, *flags: str, **kwargs) -> None:
    try:
        group.add_argument(*flags, **kwargs)
    except argparse.ArgumentError:
        # The parser already defines this shared flag (--host, --port, --api-key, ...): reuse it.
        pass


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the router's flags to `parser` (flags the parser already has are left as they are)."""
    d = RouterConfig()
    group = parser.add_argument_group("router")
    _add(group, "--host", default=None, help=f"HTTP bind host (default {d.host})")
    _add(group, "--port", type=int, default=None, help=f"HTTP port (default {d.port})")
    group.add_argument("--registry-host", default=None,
                       help=f"bind host of the ZMQ registry socket (default {d.registry_host})")
    group.add_argument("--registry-port", type=int, default=None,
                       help=f"port of the ZMQ registry socket instances ping (default {d.registry_port})")
    group.add_argument("--routing-policy", choices=["round_robin", "least_load"], default=None,
                       help=f"how to pick among instances of one role (default {d.routing_policy})")
    group.add_argument("--kv-mode", choices=["write", "read"], default=None,
                       help=f"PD KV transfer mode: write = prefill pushes, read = decode pulls (default {d.kv_mode})")
    group.add_argument("--ping-interval", dest="ping_interval_s", type=float, default=None,
                       help=f"seconds between instance pings (default {d.ping_interval_s})")
    group.add_argument("--instance-timeout", dest="instance_timeout_s", type=float, default=None,
                       help=f"drop an instance silent this many seconds (default {d.instance_timeout_s})")
    group.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                       help="fail a request whose upstream is silent this many seconds "
                            f"(default {d.request_timeout_s})")
    group.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=None,
                       help=f"seconds to connect to an instance before it is marked unhealthy "
                            f"(default {d.connect_timeout_s})")
    group.add_argument("--health-check-timeout", dest="health_check_timeout_s", type=float, default=None,
                       help=f"seconds an instance's /health may take at registration (default "
                            f"{d.health_check_timeout_s})")
    _add(group, "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    _add(group, "--log-level", default=None, help=f"log level (default {d.log_level})")
    _add(group, "--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=None,
         help=f"on SIGTERM, seconds open requests get to finish (default {d.shutdown_timeout_s:g})")
    _add(group, "--disable-docs", action="store_true", default=None,
         help="do not serve /docs, /redoc and /openapi.json")
    return parser

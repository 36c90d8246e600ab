"""The PD roles: prefill / decode instances (a collocated server with a KV-transfer role that
registers with a router) and `disagg` (router + N prefill + M decode on one node, one tree).
"""
import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from tandem.engine.config import EngineConfig, KVTransferConfig, add_engine_args
from tandem.server.disagg_ports import (InstancePorts, add_disagg_port_args, check_instance_ports, check_ports_free,
                                         instance_ports, plan_ports)
from tandem.server.lifecycle import PortInUseError

logger = logging.getLogger("tandem.server.roles")

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--router-address", default="127.0.0.1:30001",
                   help="prefill/decode: the router's registry (host:port) to register with")
    g.add_argument("--advertise-host", default="127.0.0.1",
                   help="prefill/decode: the address the router and peers use to reach this instance")
    g.add_argument("--kv-transport", choices=["tcp", "ipc", "mori", "nixl"], default="tcp",
                   help="prefill/decode/disagg: how KV blocks move (ipc: GPUs of one node; nixl: NVIDIA RDMA "
                        "across nodes; mori: ROCm RDMA)")
    g.add_argument("--kv-port", type=int, default=None,
                   help="prefill/decode: KV handshake port (default --port + 1); rank r's KV data port is "
                        "KV+1+r, then with TP > 1 the torch.distributed rendezvous is KV+1+TP unless "
                        "--master-port is given (0: free KV ports)")
    g.add_argument("--num-prefill", type=int, default=1, help="disagg: prefill instances")
    g.add_argument("--num-decode", type=int, default=1, help="disagg: decode instances")
    g.add_argument("--prefill-gpus", default=None,
                   help="disagg: first GPU of each prefill instance, e.g. 0,1 (default: in order after none)")
    g.add_argument("--decode-gpus", default=None,
                   help="disagg: first GPU of each decode instance, e.g. 2,3 (default: in order after the prefills)")
    g.add_argument("--prefill-tp", type=int, default=None,
                   help="disagg: --tensor-parallel-size of each prefill instance (default: --tensor-parallel-size)")
    g.add_argument("--decode-tp", type=int, default=None,
                   help="disagg: --tensor-parallel-size of each decode instance (default: --tensor-parallel-size)")
    # the router's flags that a disagg tree passes on (`server --role router --help` lists them all)
    g.add_argument("--registry-port", type=int, default=None,
                   help="disagg: port of the router's registry socket the instances ping (default: --base-port)")
    g.add_argument("--registry-host", default=None,
                   help="disagg: bind host of the router's registry socket (default 127.0.0.1: this node's "
                        "instances only)")
    g.add_argument("--routing-policy", choices=["round_robin", "least_load"], default=None,
                   help="disagg: how the router picks among instances of one role (default: the router's, "
                        "round_robin)")
    g.add_argument("--kv-mode", choices=["write", "read"], default=None,
                   help="disagg: PD KV transfer mode: write = prefill pushes, read = decode pulls (default: the "
                        "router's, write)")
    for flag, what in _ROUTER_TIMEOUTS.items():
        g.add_argument(flag, dest=_dest(flag), type=float, default=None, help=f"disagg: the router's {flag} ({what})")
    add_disagg_port_args(g)


# the router's timeouts a disagg tree passes on (seconds; `server --role router --help` says more)
_ROUTER_TIMEOUTS = {"--request-timeout": "an upstream silent this long fails the request",
                    "--connect-timeout": "connecting to an instance", "--instance-timeout":
                    "an instance silent this long is dropped", "--ping-interval": "instances' registry pings",
                    "--health-check-timeout": "one /health probe"}


def _dest(flag: str) -> str:
    """argparse dest of a disagg router flag: the router's own (its timeouts end in _s)."""
    name = flag.lstrip("-").replace("-", "_")
    return name + "_s" if flag in _ROUTER_TIMEOUTS else name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def pd_config(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The instance's EngineConfig with its KV-transfer part filled in: kv_role from the role,
    --kv-transfer-config's connector and extra settings (timeouts, ...) kept, and concrete ports
    (instance_ports(): handshake, per-rank KV data, TP rendezvous), so they can be advertised."""
    kv = KVTransferConfig(kv_connector=config.kv_transfer.kv_connector or "TandemConnector",
                          kv_role=KV_ROLES[args.role],
                          kv_connector_extra_config=dict(config.kv_transfer.kv_connector_extra_config))
    extra = {"transport": args.kv_transport, "kv_host": args.advertise_host, **kv.kv_connector_extra_config}
    ports = instance_pd_ports(args, config, int(extra.get("handshake_port", 0)))
    extra["handshake_port"] = ports.kv or free_port()  # advertised to the router, so concrete
    extra.setdefault("data_port", ports.kv_data)
    extra.setdefault("engine_id", f"{args.role}-{args.advertise_host}-{args.port}-{uuid.uuid4().hex[:6]}")
    parallel = config.parallel
    if ports.master is not None:
        parallel = dataclasses.replace(parallel, master_port=ports.master)
    return dataclasses.replace(config, parallel=parallel,
                               kv_transfer=dataclasses.replace(kv, kv_connector_extra_config=extra))


def instance_pd_ports(args: argparse.Namespace, config: EngineConfig, handshake_port: int = 0) -> InstancePorts:
    """A prefill/decode instance's ports: --kv-port (or the config's handshake_port), default
    --port + 1, and what follows it; --master-port wins for the rendezvous."""
    kv = handshake_port or (args.kv_port if args.kv_port is not None else (args.port + 1 if args.port else 0))
    return instance_ports(args.port, kv, config.parallel.tensor_parallel_size, getattr(args, "master_port", None))


def check_pd_ports(args: argparse.Namespace, config: EngineConfig) -> None:
    """Log the instance's ports; PortInUseError when one is taken (the HTTP one is bound already)."""
    extra, tp = config.kv_transfer.kv_connector_extra_config, config.parallel.tensor_parallel_size
    ports = InstancePorts(args.port, int(extra["handshake_port"]), int(extra.get("data_port", 0)), tp,
                          config.parallel.master_port if tp > 1 else None)
    logger.info("%s ports: %s", args.role, ports.describe())
    check_instance_ports(ports, "this instance", "--kv-port / --master-port", set(), http_bound=True)


def start_registration(args: argparse.Namespace, config: EngineConfig, client):
    """Register with the router (and keep pinging with the engine's load)."""
    from tandem.server.registry_protocol import InstanceInfo
    from tandem.server.registration import RegistrationClient

    extra = config.kv_transfer.kv_connector_extra_config
    info = InstanceInfo(instance_id=extra["engine_id"], role=args.role,
                        http_address=f"http://{args.advertise_host}:{args.port}", engine_id=extra["engine_id"],
                        kv_host=extra["kv_host"], kv_handshake_port=int(extra["handshake_port"]),
                        kv_notify_port=int(extra["handshake_port"]), tp_size=config.parallel.tensor_parallel_size)

    def load() -> dict:
        s = client.last_stats
        return {"num_running": s.num_running, "num_waiting": s.num_waiting + s.num_waiting_for_remote_kvs,
                "kv_cache_usage": s.kv_cache_usage}

    reg = RegistrationClient(args.router_address, info, 1.0, load)
    reg.start()
    logger.info("%s instance %s registering with the router at %s", args.role, info.instance_id, args.router_address)
    return reg


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of args, as a command line for a child instance."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    out = []
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if value is None or not action.option_strings:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            out += [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _gpus_in_order(args: argparse.Namespace, tp: dict[str, int]) -> tuple[list, list]:
    """disagg: each instance's first GPU (its TP ranks take the GPUs after it): as given by
    --prefill-gpus / --decode-gpus, else in order (prefills first) on a GPU machine; None on CPU."""
    given = {"prefill": args.prefill_gpus, "decode": args.decode_gpus}
    counts = {"prefill": args.num_prefill, "decode": args.num_decode}
    on_gpu = args.device not in ("cpu",) and (args.device or "auto").startswith(("auto", "cuda"))
    if on_gpu and not any(given.values()):
        import torch
        on_gpu = torch.cuda.is_available()
    out, nxt = {}, 0
    for role in ("prefill", "decode"):
        if given[role]:
            out[role] = [int(g) for g in given[role].split(",")]
        elif on_gpu:
            out[role] = [nxt + i * tp[role] for i in range(counts[role])]
        else:
            out[role] = [None] * counts[role]
        nxt = max([g + tp[role] for g in out[role] if g is not None] + [nxt])
    return out["prefill"], out["decode"]


def _die_with_parent() -> None:
    import ctypes
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_disagg(args: argparse.Namespace) -> int:
    """Router + prefill + decode instances as children; any child's death stops the tree. Every
    port is fixed (and checked free) before the first child starts. SIGTERM drains the router
    first, then the instances. The API key reaches the children through the environment (not
    their command lines, which `ps` shows)."""
    tp = {"prefill": args.prefill_tp or args.tensor_parallel_size or 1,
          "decode": args.decode_tp or args.tensor_parallel_size or 1}
    ports = plan_ports(args, tp)
    try:
        check_ports_free(ports, args.host, args.port)
    except PortInUseError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("disagg ports: %s", ports.describe(args.port))
    registry_port = ports.registry
    common = ["--log-level", args.log_level]
    if args.shutdown_timeout_s is not None:
        common += ["--shutdown-timeout", str(args.shutdown_timeout_s)]
    env = dict(os.environ)
    if args.api_key:
        env["TANDEM_API_KEY"] = args.api_key
    prefill_gpus, decode_gpus = _gpus_in_order(args, tp)
    if len(prefill_gpus) != args.num_prefill or len(decode_gpus) != args.num_decode:
        raise SystemExit("server: --prefill-gpus / --decode-gpus must list one GPU per instance")
    children: list[tuple[str, subprocess.Popen]] = []

    def spawn(name: str, argv: list[str], module: str = "tandem.server") -> None:
        cmd = [sys.executable, "-m", module, *argv, *common]
        children.append((name, subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=env)))
        logger.info("started %s: %s", name, " ".join(cmd))

    router_argv = ["--host", args.host, "--port", str(args.port),
                   "--registry-port", str(registry_port),  # the instances register over loopback
                   "--registry-host", args.registry_host or "127.0.0.1"]
    for flag in ("--routing-policy", "--kv-mode", *_ROUTER_TIMEOUTS):
        if getattr(args, _dest(flag), None) is not None:
            router_argv += [flag, str(getattr(args, _dest(flag)))]
    spawn("router", router_argv, "tandem.router")  # the router's own CLI: the server never imports it
    base = _without_flags(engine_argv(args), ("--tensor-parallel-size", "--master-port", "--device"))
    for role, gpus, role_ports in (("prefill", prefill_gpus, ports.prefill), ("decode", decode_gpus, ports.decode)):
        for i, gpu in enumerate(gpus):
            argv = ["--role", role, "--host", "127.0.0.1", "--port", str(role_ports[i].http),
                    "--kv-port", str(role_ports[i].kv),
                    "--router-address", f"127.0.0.1:{registry_port}", "--kv-transport", args.kv_transport, *base,
                    "--tensor-parallel-size", str(tp[role])]
            if role_ports[i].master is not None:  # the instance's torch.distributed rendezvous (loopback only)
                argv += ["--master-port", str(role_ports[i].master)]
            if gpu is not None:
                argv += ["--device", f"cuda:{gpu}"]
            elif args.device is not None:
                argv += ["--device", args.device]
            spawn(f"{role}-{i}", argv)

    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while not stopping:
        dead = [(n, p) for n, p in children if p.poll() is not None]
        if dead:
            for n, p in dead:
                logger.error("%s exited with code %s; stopping the deployment", n, p.returncode)
            code = 1
            break
        time.sleep(0.2)
    grace = (args.shutdown_timeout_s if args.shutdown_timeout_s is not None else 30.0) + 15.0
    _stop_in_order([children[:1], children[1:]], grace)  # the router drains first: no new work reaches instances
    return code


def _stop_in_order(waves: list[list[tuple[str, subprocess.Popen]]], grace_s: float) -> None:
    """SIGTERM each wave and wait for it (SIGKILL after grace_s) before the next."""
    for wave in waves:
        for _, p in wave:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for name, p in wave:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s of SIGTERM; killing it", name, grace_s)
                p.kill()
                p.wait()

"""The PD roles: prefill / decode instances (a collocated server with a KV-transfer role that
registers with a router) and `disagg` (router + N prefill + M decode on one node, one tree).
"""
import argparse
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import uuid

from tandem.engine.config import EngineConfig, KVTransferConfig, add_engine_args

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
    g.add_argument("--kv-port", type=int, default=0, help="prefill/decode: KV handshake port (0: a free one)")
    g.add_argument("--num-prefill", type=int, default=1, help="disagg: prefill instances")
    g.add_argument("--num-decode", type=int, default=1, help="disagg: decode instances")
    g.add_argument("--prefill-gpus", default=None, help="disagg: GPU per prefill instance, e.g. 0,1")
    g.add_argument("--decode-gpus", default=None, help="disagg: GPU per decode instance, e.g. 2,3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def pd_config(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The instance's EngineConfig with its KV-transfer part filled in: kv_role from the role,
    --kv-transfer-config's connector and extra settings (timeouts, ...) kept, and a concrete
    handshake port, so it can be advertised."""
    kv = KVTransferConfig(kv_connector=config.kv_transfer.kv_connector or "TandemConnector",
                          kv_role=KV_ROLES[args.role],
                          kv_connector_extra_config=dict(config.kv_transfer.kv_connector_extra_config))
    extra = {"transport": args.kv_transport, "kv_host": args.advertise_host, **kv.kv_connector_extra_config}
    if not int(extra.get("handshake_port", 0)):
        extra["handshake_port"] = args.kv_port or free_port()
    extra.setdefault("engine_id", f"{args.role}-{args.advertise_host}-{args.port}-{uuid.uuid4().hex[:6]}")
    return dataclasses.replace(config, kv_transfer=dataclasses.replace(kv, kv_connector_extra_config=extra))


def start_registration(args: argparse.Namespace, config: EngineConfig, client):
    """Register with the router (and keep pinging with the engine's load)."""
    from tandem.router.protocol import InstanceInfo
    from tandem.router.registration import RegistrationClient

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


def _die_with_parent() -> None:
    import ctypes
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_disagg(args: argparse.Namespace) -> int:
    """Router + prefill + decode instances as children; any child's death stops the tree."""
    registry_port = args.registry_port or free_port()
    common = ["--log-level", args.log_level] + (["--api-key", args.api_key] if args.api_key else [])
    prefill_gpus = args.prefill_gpus.split(",") if args.prefill_gpus else [None] * args.num_prefill
    decode_gpus = args.decode_gpus.split(",") if args.decode_gpus else [None] * args.num_decode
    if len(prefill_gpus) != args.num_prefill or len(decode_gpus) != args.num_decode:
        raise SystemExit("server: --prefill-gpus / --decode-gpus must list one GPU per instance")
    children: list[tuple[str, subprocess.Popen]] = []

    def spawn(name: str, argv: list[str]) -> None:
        cmd = [sys.executable, "-m", "tandem.server", *argv, *common]
        children.append((name, subprocess.Popen(cmd, preexec_fn=_die_with_parent)))
        logger.info("started %s: %s", name, " ".join(cmd))

    router_argv = ["--role", "router", "--host", args.host, "--port", str(args.port),
                   "--registry-port", str(registry_port)]
    for flag in ("routing_policy", "kv_mode"):
        if getattr(args, flag, None):
            router_argv += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    spawn("router", router_argv)
    base = engine_argv(args)
    for role, gpus in (("prefill", prefill_gpus), ("decode", decode_gpus)):
        for i, gpu in enumerate(gpus):
            argv = ["--role", role, "--host", "127.0.0.1", "--port", str(free_port()),
                    "--router-address", f"127.0.0.1:{registry_port}", "--kv-transport", args.kv_transport, *base]
            if gpu is not None:
                argv += ["--device", f"cuda:{gpu}"]
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
    for _, p in children:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 15
    for _, p in children:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    return code

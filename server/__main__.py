"""`server` / `python -m tandem.server`: start one part of a deployment by role.

collocated (default): API process + engine core process serving the OpenAI API.
prefill / decode: a collocated server with a KV-transfer role, registered with a router.
router: the PD proxy; this process becomes `python -m tandem.router`, whose flags
`server --role router --help` lists. disagg: router + prefill + decode in one process tree.
"""
import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from tandem.server.auth import resolve_api_key
from tandem.server.lifecycle import StopRequested, raise_stop

logger = logging.getLogger("tandem.server")

ROLES = ("collocated", "prefill", "decode", "router", "disagg")
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    from tandem.engine.config import add_engine_args

    parser = argparse.ArgumentParser(prog="server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=ROLES, default="collocated", help="which part of a deployment to start")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (bound before the model loads)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on /v1 routes and the API docs (visible in "
                             "`ps`: prefer --api-key-file or the TANDEM_API_KEY environment variable)")
    parser.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    parser.add_argument("--disable-docs", action="store_true", default=None,
                        help="do not serve /docs, /redoc and /openapi.json")
    parser.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=None,
                        help=f"on SIGTERM, seconds open requests get to finish before they are aborted "
                             f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"),
                        help="log level of every process of this deployment")
    add_engine_args(parser)
    from tandem.server.roles import add_pd_args
    add_pd_args(parser)
    return parser


def run_api_server(args: argparse.Namespace) -> int:
    """API process + engine core process; returns the exit code (1 if the engine core died or
    failed to start). The HTTP port (and the KV port of a PD instance) is bound before the model
    loads; /health answers 503 until it has loaded."""
    from tandem.engine.config import config_from_args
    from tandem.server.engine_client import EngineClient, EngineStartupError
    from tandem.server.lifecycle import GracefulServer, Lifecycle, PortInUseError, bind_socket

    config = config_from_args(args)
    try:
        sock = bind_socket(args.host, args.port, "the HTTP API")
        if args.role in ("prefill", "decode"):
            from tandem.server.roles import check_pd_ports, pd_config
            config = pd_config(args, config)
            check_pd_ports(args, config)
    except PortInUseError as exc:
        logger.error("%s", exc)
        return 1
    lifecycle = Lifecycle()
    registration = []
    client = EngineClient(config, args.log_level)
    previous = {s: signal.signal(s, raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        client.start()
        # the rest loads while the engine core loads the model (the app's modules import torch)
        import uvicorn

        from tandem.server.api import build_app
        from tandem.server.tokenizer import Tokenizer

        tokenizer = None
        try:  # load the tokenizer while the engine core loads the model
            tokenizer = Tokenizer(config.model.tokenizer or config.model.model)
        except Exception:  # the engine's start-up error, if any, says more; the app retries with its path
            logger.debug("tokenizer not loaded from %s before the engine", config.model.model, exc_info=True)
        app = build_app(client, config, tokenizer, args.api_key, role=args.role, lifecycle=lifecycle,
                        docs=not args.disable_docs)
        timeout = args.shutdown_timeout_s if args.shutdown_timeout_s is not None else DEFAULT_SHUTDOWN_TIMEOUT_S
        server = GracefulServer(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=timeout,
                                               timeout_keep_alive=30), lifecycle)
        client.on_dead = lambda: setattr(server, "should_exit", True)
        lifecycle.on_failed.append(lambda: setattr(server, "should_exit", True))

        async def serving() -> None:
            await server.wait_started()
            logger.info("serving %s on http://%s:%d", config.model.model, args.host, args.port)
            if args.role in ("prefill", "decode"):  # the router health-checks at once: we answer 200 now
                from tandem.server.roles import start_registration
                registration.append(start_registration(args, config, client))

        lifecycle.on_ready.append(serving)
        lifecycle.on_drain.append(lambda: [r.stop() for r in registration])  # the router stops routing here
        logger.info("listening on http://%s:%d (503 until the model is loaded)", args.host, args.port)
        server.run(sockets=[sock])
    except StopRequested as exc:
        logger.info("%s received; stopping", exc)
    finally:
        for reg in registration:
            reg.stop()
        client.cancel_start()
        client.shutdown()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if lifecycle.status == "failed":
        err = lifecycle.error
        logger.error("%s", err if isinstance(err, EngineStartupError) else f"start-up failed: {err!r}")
        return 1
    if client.dead:
        logger.error("exiting with an error: an engine core process died (exit code %s)", client.dead_exitcode)
        return 1
    return 0


def split_role(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--role's value or None, the command line without --role), read ahead of the full parse."""
    pre = argparse.ArgumentParser(prog="server", add_help=False)
    pre.add_argument("--role", default=None)
    known, rest = pre.parse_known_args(argv)
    return known.role, rest


def exec_router(argv: list[str]) -> NoReturn:
    """--role router: this process becomes `python -m tandem.router ARGV` (os.execv keeps the pid,
    so signals, the SIGTERM drain and the exit code are the router's own). The router's CLI parses
    its flags and --help: the server never imports the router (ARCHITECTURE.md: imports follow
    client -> router -> server)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tandem.router", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    role, rest = split_role(argv)
    if role == "router":
        exec_router(rest)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.api_key = resolve_api_key(args)
    if args.role == "disagg":
        from tandem.server.roles import run_disagg
        return run_disagg(args)
    if (args.node_rank or 0) > 0:
        return run_node(args)
    return run_api_server(args)


def run_node(args: argparse.Namespace) -> int:
    """--node-rank > 0: this node's ranks only (node 0 runs the API and the scheduler)."""
    from tandem.engine.config import config_from_args
    from tandem.engine.worker import run_node_workers

    logger.info("node %d: starting this node's ranks; node 0 serves the API", args.node_rank)
    run_node_workers(config_from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

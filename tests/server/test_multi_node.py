"""Torchrun-style launch on one machine: `server --nnodes 2 --node-rank 0|1` with TP 2 spread over
the two "nodes" (loopback). Reference: the greedy output of a single-process server (the suite's
shared one: the same model and engine flags)."""
import httpx

from tests.ports import free_port_range
from tests.server.conftest import API_KEY, ServerProcess, stop_all

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:"


def _greedy(url: str, model: str, headers: dict[str, str] | None = None) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()["choices"][0]["text"]


def test_node_rank_one_joins_node_zero(tiny_model_dir, server, tmp_path):
    multi = ["--served-model-name", "m", "--tensor-parallel-size", "2", "--nnodes", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port_range(1))]
    node1 = ServerProcess.for_model(tiny_model_dir, tmp_path / "node1.log", *multi, "--node-rank", "1")
    node0 = ServerProcess.for_model(tiny_model_dir, tmp_path / "node0.log", *multi, "--node-rank", "0")
    try:
        expected = _greedy(server.url, "default", {"Authorization": f"Bearer {API_KEY}"})  # while the nodes start
        assert _greedy(node0.wait_healthy().url, "m") == expected
        assert node1.proc.poll() is None, node1.read_log()
    finally:
        stop_all([node0, node1])

"""A `--role disagg` tree with TP=2 instances (CPU, gloo, tcp transport) on --base-port: every TCP
port its processes listen on is one the tree derived from the base and printed at start-up, and a
request through it gives the collocated answer. References: the printed layout (HTTP, KV
handshake, KV data per rank, rendezvous; the --base-port help) and a collocated TP=1 server.

The one exception, asserted exactly: gloo's own rank-to-rank listener, one per TP rank process on
loopback; torch.distributed has no setting for its port (nor NCCL for its bootstrap ones)."""
import re

import openai
import psutil
import pytest

from tests.e2e.conftest import ENGINE_ARGS, Proc, collocated_answers, wait_all_blocks_free
from tests.ports import free_port_range

pytestmark = pytest.mark.slow

PROMPT = "Question: Tom has 3 apples and buys 6 more. How many now?\nAnswer:"
TP = 2
NUM_PORTS = 1 + 2 * (2 + TP + 1)  # registry, then per instance HTTP, KV, KV data per rank, rendezvous


def complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text


def printed_ports(log: str) -> dict[str, list[int]]:
    """'disagg ports: router http=A registry=B; prefill-0 http=C kv=D kv-data=E-F master=G; ...' ->
    {part: [ports]}, ranges expanded."""
    line = next(l for l in log.splitlines() if "disagg ports:" in l).split("disagg ports:", 1)[1]
    out = {}
    for part in line.split(";"):
        name, *fields = part.split()
        ports = []
        for lo, hi in re.findall(r"=(\d+)(?:-(\d+))?", " ".join(fields)):
            ports += list(range(int(lo), int(hi or lo) + 1))
        out[name] = ports
    return out


def listeners(root_pid: int) -> dict[psutil.Process, list]:
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    return {p: [c.laddr for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN] for p in procs}


def test_tp2_tree_listens_only_on_its_printed_ports(model_dir, tmp_path_factory):
    base = free_port_range(NUM_PORTS)
    tree = Proc("disagg", ["--role", "disagg", "--model", str(model_dir), "--served-model-name", "default",
                           *ENGINE_ARGS, "--tensor-parallel-size", str(TP), "--base-port", str(base)],
                tmp_path_factory.mktemp("tree"))
    try:
        expected = collocated_answers(model_dir, tmp_path_factory.mktemp("colloc"), complete)  # while the tree starts
        tree.wait_healthy(300)
        assert complete(tree.url) == expected
        printed = printed_ports(tree.read_log())
        assert printed["router"] == [tree.port, base]
        assert sorted(p for name, ports in printed.items() if name != "router" for p in ports) == \
            list(range(base + 1, base + NUM_PORTS))
        derived = {p for ports in printed.values() for p in ports}
        rendezvous = {printed[f"{r}-0"][-1] for r in ("prefill", "decode")}  # torch's TCPStore: every interface
        found, others = set(), {}
        for proc, addrs in listeners(tree.proc.pid).items():
            found |= {a.port for a in addrs if a.port in derived}
            others[proc] = [a for a in addrs if a.port not in derived]
            assert all(a.ip == "127.0.0.1" for a in addrs if a.port in derived - rendezvous), addrs
        assert found == derived  # every printed port is in use (none is a stale promise)
        # gloo: exactly one loopback listener per rank process (the engine core and its rank-1 worker)
        ranks = [p for p in others if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2 * TP, [p.cmdline() for p in ranks]
        for proc, addrs in others.items():
            want = 1 if proc in ranks else 0
            assert len(addrs) == want and all(a.ip == "127.0.0.1" for a in addrs), (proc.cmdline(), addrs)
        wait_all_blocks_free([f"http://127.0.0.1:{printed[f'{r}-0'][0]}" for r in ("prefill", "decode")])
    finally:
        assert tree.stop(90) == 0

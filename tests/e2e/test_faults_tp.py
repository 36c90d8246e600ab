"""Faults with TP: a prefill rank dies in the middle of a transfer, or the client goes away while
one is in flight. Decode ends the request, both sides free every block, nothing hangs.
References: the blocks gauges at idle, and a collocated TP=1 server's greedy text afterwards.

One D TP2 serves every test of the module (no test kills it; each ends with all of its blocks
free): the client-abort tests first, with P TP2 p-a (a rank is stopped and resumed, no process
dies), then the killed-prefill tests, each killing the prefill it finds running or a fresh one."""
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_ARGS, Proc, metric, wait_all_blocks_free
from tests.e2e.test_disagg_tp import Tree
from tests.e2e.test_faults import LONG

pytestmark = pytest.mark.slow


def _rank_pid(engine_pid: int) -> int:
    """The TP worker (rank 1) under an engine core."""
    for pid in map(int, Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise RuntimeError("no TP worker found")


def _abort_count(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith("tandem:request_success_total") and 'finished_reason="abort"' in line)


def _waiting_for_kv(url: str) -> bool:
    return metric(url, "num_requests_waiting_for_remote_kvs") > 0


def _holding(url: str) -> bool:
    return metric(url, "num_requests_running") == 0 and \
        metric(url, "kv_cache_free_blocks") < metric(url, "kv_cache_total_blocks")


# One prompt per test: on the shared tree the other tests' prompts sit in the instances' prefix
# caches, and a decode finding one there would receive only its tail.
ABORT_PROMPTS = {"write": LONG, "read": LONG.replace("Question:", "Task:", 1)}
KILL_PROMPTS = {"write": LONG.replace("Question:", "Problem:", 1), "read": LONG.replace("Question:", "Query:", 1)}


@pytest.fixture(scope="module")
def shared_tree(model_dir, tmp_path_factory):
    """P TP2 p-a + D TP2 d-a, and the collocated TP=1 server's text for each client-abort prompt."""
    log_dir = tmp_path_factory.mktemp("shared-tree")
    ref = Proc("collocated", ["--model", str(model_dir), "--served-model-name", "default", *ENGINE_ARGS], log_dir)
    tree = Tree(model_dir, [], log_dir)
    try:
        tree.start("p-a", "prefill", 2)
        tree.start("d-a", "decode", 2)
        expected = {mode: _text(ref.wait_healthy().url, prompt) for mode, prompt in ABORT_PROMPTS.items()}
        ref.stop()
        yield tree, expected
    finally:
        ref.stop()
        tree.close()


@pytest.mark.parametrize("mode", ["write", "read"])
def test_client_abort_mid_transfer_frees_both_sides(shared_tree, mode):
    """P TP2 + D TP2. One rank is stopped (SIGSTOP) so the transfer cannot finish: in write mode
    prefill's rank 1 (decode has announced its blocks and waits for the push), in read mode
    decode's rank 1 (prefill holds its blocks, decode's read step cannot finish). The client
    closes its streaming connection, the rank resumes; every rank's blocks come back within a
    bound shorter than the transfer and hold timeouts (8 s), and the next request gets the
    collocated text."""
    tree, expected = shared_tree
    prefill, decode = _live_prefill(tree), tree.instances["d-a"]
    url = tree.route(mode)
    aborts = _abort_count(decode.url)  # (the tree's earlier tests' aborts)
    stopped = _rank_pid((prefill if mode == "write" else decode).engine_pid())
    os.kill(stopped, signal.SIGSTOP)
    try:
        body = json.dumps({"model": "default", "prompt": ABORT_PROMPTS[mode], "max_tokens": 32, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        # The transfer is in flight: decode waits for the push (write), or prefill holds the
        # finished prompt's blocks for decode, whose engine is stuck in the read's step (read).
        watched, in_flight = (decode, _waiting_for_kv) if mode == "write" else (prefill, _holding)
        deadline = time.monotonic() + 30
        while not in_flight(watched.url):
            assert time.monotonic() < deadline, f"no transfer in flight ({mode})"
            time.sleep(0.1)
        if mode == "read":
            time.sleep(1)  # the router has handed the request to decode
        sock.close()  # the client goes away mid-transfer
        if mode == "write":  # decode's engine runs: it sees the abort while prefill is stalled
            deadline = time.monotonic() + 10
            while _abort_count(decode.url) == aborts:
                assert time.monotonic() < deadline, "decode never saw the abort"
                time.sleep(0.1)
        else:
            time.sleep(2)
    finally:
        os.kill(stopped, signal.SIGCONT)
    # Freed by the abort itself (0.1-0.2 s on CPU), not by the 8 s transfer or hold timeouts.
    wait_all_blocks_free([prefill.url, decode.url], timeout=6)
    assert metric(decode.url, "num_requests_running") == 0
    assert _abort_count(decode.url) == aborts + 1, "decode must end the request as aborted, not finish it"
    assert _text(url, ABORT_PROMPTS[mode]) == expected[mode], "a request after the abort must get the collocated text"
    wait_all_blocks_free([prefill.url, decode.url])


def _text(url: str, prompt: str = LONG) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0).choices[0].text


def _live_prefill(tree: Tree, name: str = "p-a") -> Proc:
    """The tree's prefill (TP2) if one is running, else a fresh one named `name` (an earlier test
    killed the last)."""
    running = [p for n, p in tree.instances.items() if n.startswith("p-") and p.proc.poll() is None]
    if not running:
        tree.start(name, "prefill", 2)
        running = [tree.instances[name]]
    return running[0]


@pytest.mark.parametrize("mode", ["write", "read"])
def test_killed_prefill_rank_fails_the_request_without_leaks(shared_tree, mode):
    """A prefill rank dies mid-request (with it the prefill instance): the client gets an error, not a
    hang, and the decode frees every block."""
    tree, _ = shared_tree
    prefill, decode = _live_prefill(tree, f"p-{mode}"), tree.instances["d-a"]
    url = tree.route(mode)
    try:
        rank = _rank_pid(prefill.engine_pid())
        os.kill(rank, signal.SIGSTOP)  # prefill hangs in its next collective
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        start = time.monotonic()
        errors = []

        def call():
            try:
                client.completions.create(model="default", prompt=KILL_PROMPTS[mode], max_tokens=8, temperature=0)
            except (openai.APIError, httpx.HTTPError) as e:
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        if mode == "write":  # the decode side has announced its blocks: the transfer is under way
            deadline = time.monotonic() + 30
            while metric(decode.url, "num_requests_waiting_for_remote_kvs") == 0:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        else:
            time.sleep(2)
        os.kill(rank, signal.SIGKILL)  # the prefill instance goes down with its rank
        t.join(40)
        assert not t.is_alive() and errors, "the client must get an error, not hang"
        assert time.monotonic() - start < 40
        wait_all_blocks_free([decode.url])
    finally:
        tree.stop(next(name for name, p in tree.instances.items() if p is prefill))

"""Faults with TP: a prefill rank dies in the middle of a transfer. Decode ends the request
with a clear error, frees every block, nothing hangs. Reference: the blocks gauges at idle."""
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import metric, wait_all_blocks_free
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


@pytest.mark.parametrize("mode", ["write", "read"])
def test_killed_prefill_rank_fails_the_request_without_leaks(model_dir, tmp_path, mode):
    tree = Tree(model_dir, [], tmp_path)
    try:
        tree.start("p-a", "prefill", 2)
        tree.start("d-a", "decode", 2)
        url = tree.route(mode)
        prefill, decode = tree.instances["p-a"], tree.instances["d-a"]
        rank = _rank_pid(prefill.engine_pid())
        os.kill(rank, signal.SIGSTOP)  # prefill hangs in its next collective
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        start = time.monotonic()
        import threading
        errors = []

        def call():
            try:
                client.completions.create(model="default", prompt=LONG, max_tokens=8, temperature=0)
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
        tree.close()

"""Faults in a PD deployment end with a clear client error and no leaked KV blocks.
(Registration of an unreachable instance is covered in tests/router.)
Over tcp only: each fault here comes before the transport moves anything (a prefill stopped before
the handshake) or after its transfer is done (a decode killed, a client gone, while decoding), so
the path is the connector's scheduler side and the router's, the same for every transport. A fault
in the middle of a transfer: tests/e2e/test_faults_tp.py."""
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.test_disagg import start_deployment
from tests.e2e.conftest import metric, wait_all_blocks_free
from tests.server.conftest import stop_all

LONG = "Question: " + " ".join(f"item {i} costs {i} dollars." for i in range(6)) + "\nAnswer:"


def _complete(url: str, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model="default", prompt=LONG, temperature=0, **kw)


def test_killed_decode_gives_client_error_and_prefill_frees(model_dir, tmp_path):
    router, (prefill, decode) = start_deployment(model_dir, tmp_path, "read", instance_timeout=2)
    try:
        errors = []

        def stream():
            try:
                for _ in _complete(router.url, max_tokens=150, stream=True, extra_body={"ignore_eos": True}):
                    pass
            except (openai.APIError, httpx.HTTPError) as e:
                errors.append(e)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while metric(decode.url, "num_requests_running") == 0:  # decode is generating
            assert time.monotonic() < deadline and t.is_alive(), errors
            time.sleep(0.05)
        decode.kill()
        t.join(60)
        assert not t.is_alive() and errors, "the client must get an error, not hang"
        wait_all_blocks_free([prefill.url])
        # The router drops the dead decode; with no decode left it answers 503 at once.
        deadline = time.monotonic() + 15
        while httpx.get(f"{router.url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        with pytest.raises(openai.APIStatusError) as err:
            _complete(router.url, max_tokens=4)
        assert err.value.status_code == 503
    finally:
        stop_all([router, prefill, decode])


def test_killed_prefill_times_out_on_decode_without_leak(model_dir, tmp_path):
    """Write mode: prefill dies before pushing; decode's transfer times out (4 s), the client
    gets an error and decode's blocks are all free again."""
    router, (prefill, decode) = start_deployment(model_dir, tmp_path, "write", instance_timeout=30)
    try:
        prefill.proc.send_signal(19)  # SIGSTOP: alive for the router, silent for the transfer
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            _complete(router.url, max_tokens=8)
        assert err.value.status_code >= 500 and time.monotonic() - start < 40
        prefill.proc.send_signal(18)  # SIGCONT
        prefill.kill()
        wait_all_blocks_free([decode.url])
    finally:
        stop_all([router, prefill, decode])


def test_client_abort_reaches_both_instances(model_dir, tmp_path):
    router, (prefill, decode) = start_deployment(model_dir, tmp_path, "write")
    try:
        body = {"model": "default", "prompt": LONG, "max_tokens": 150, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 30
        while not any('finished_reason="abort"' in line and not line.endswith(" 0.0")
                      for line in httpx.get(f"{decode.url}/metrics").text.splitlines()
                      if line.startswith("tandem:request_success_total")):
            assert time.monotonic() < deadline, "decode never saw the abort"
            time.sleep(0.3)
        assert metric(decode.url, "num_requests_running") == 0
        wait_all_blocks_free([prefill.url, decode.url])
    finally:
        stop_all([router, prefill, decode])

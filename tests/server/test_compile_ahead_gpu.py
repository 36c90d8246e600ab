"""No kernel compiles while serving (GPU): a server started with compile-ahead serves a varied load
(many prompt lengths, batch mixes, sampling parameters) and its
tandem:kernel_compilations_after_ready_total stays 0; its first request's TTFT is within 2x of
the steady state. Reference: the counter of kernels/compile_watch.py, and the same request's
TTFT measured again once the server is warm.

Model: the embedded default model, or TANDEM_TEST_MODEL_ARGS (e.g. "--model /m --load-format
dummy --tokenizer /t") for a production shape."""
import concurrent.futures as cf
import os
import random
import shlex
import statistics
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.gpu


def _ttft(url: str, prompt: list[int], **params) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True, **params}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - t0
    raise AssertionError("no token streamed")


def _compilations(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem:kernel_compilations_after_ready_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tandem:kernel_compilations_after_ready_total on /metrics")


SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20),
            dict(temperature=0.7, min_p=0.05, seed=3), dict(temperature=0.0, logprobs=3),
            dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
            dict(temperature=0.0, min_tokens=4), dict(temperature=0.0, echo=True, logprobs=1)]


def test_no_kernel_compiles_while_serving(tmp_path):
    extra = shlex.split(os.environ.get("TANDEM_TEST_MODEL_ARGS", ""))
    server = ServerProcess(tmp_path / "server.log", ["--served-model-name", "m", "--max-model-len", "4096",
                                                     "--max-num-seqs", "64", *extra])
    try:
        server.wait_healthy(1800)
        max_len = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        probe = [11 + i % 500 for i in range(min(1000, max_len // 2))]
        first = _ttft(server.url, probe)
        rng = random.Random(0)
        lengths = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 127, 129, 255, 500, 1000, 1023, 2000, 3000, 4000]

        def one(i: int) -> None:
            n = lengths[i % len(lengths)] if i < 60 else rng.randint(1, 4000)
            n = min(n, max_len - 100)  # room for the longest max_tokens below
            prompt = [rng.randrange(10, 500) for _ in range(n)]
            params = SAMPLING[i % len(SAMPLING)]
            max_tokens = max(rng.choice([1, 2, 8, 40, 90]), params.get("min_tokens", 0))  # min > max is a 400
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                    "stream": bool(i % 2), "ignore_eos": True, **params}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).raise_for_status()

        # batch mixes: one at a time, then waves of 4, 16 and 64 concurrent requests
        for i in range(len(lengths)):
            one(i)
        for width in (4, 16, 64):
            with cf.ThreadPoolExecutor(width) as pool:
                list(pool.map(one, range(width * 3)))
        assert _compilations(server.url) == 0, f"kernels compiled while serving; see {server.log_path}"
        steady = statistics.median(_ttft(server.url, probe) for _ in range(5))
        assert first <= 2 * steady + 0.005, f"first TTFT {first * 1e3:.1f} ms vs steady {steady * 1e3:.1f} ms"
    finally:
        server.stop()

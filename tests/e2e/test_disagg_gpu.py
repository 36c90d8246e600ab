"""PD on one GPU (prefill and decode instances both on cuda:0, `--kv-transport ipc`; and `nixl`,
VRAM over UCX, with the default model when its extra is installed), and across two GPUs (decode on
cuda:1) where there are two, against a collocated server with the same flags, one request at a
time (equal batch composition).
Reference: the collocated server's top_logprobs, compared with float equality (bf16 model).

Models: the embedded default model, a dummy Llama-3-8B-shaped model (`--load-format dummy`:
both instances draw the same weights from the same --seed on the same device), and the seeds'
kind of deployment on one GPU: a dummy Qwen3-30B-A3B-shaped block-scaled FP8 MoE (8 of its 48
layers) with an fp8 KV cache (`--kv-cache-dtype fp8`), whose KV blocks move as fp8. Chunked cases set a
step budget under the longer prompts (`--max-num-batched-tokens`), on collocated and PD alike, so
those prompts are prefilled in several chunks (and, in write mode, pushed chunk by chunk)."""
import importlib.util
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.fp8_gpu import fp8_gpu_dtype
from tests.ports import free_port_range
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

KV_BYTES = "4000000000"  # per instance, so that collocated or prefill + decode fit on one GPU
LENGTHS = [50, 300, 700, 950, 2000]
NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="the nixl extra is not installed")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % (vocab - 20) + 10 for i in range(n)]


def ask(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "default", **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def exit_report(p: ServerProcess) -> str:
    """Why a server tree exited: its log's ERROR lines and last traceback (another process's lines
    can bury them in the tail), then the tail."""
    log = p.read_log()
    errors = [line for line in log.splitlines() if " ERROR " in line or "Error: " in line]
    traceback = log[log.rfind("Traceback"):][:3000] if "Traceback" in log else ""
    return "\n".join(errors[-20:]) + "\n" + traceback + "\n...\n" + log[-2000:]


def wait_serving(p: ServerProcess, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, exit_report(p)
        try:
            if httpx.post(f"{p.url}/v1/completions", json={"model": "default", "prompt": [5, 6, 7], "max_tokens": 2},
                          timeout=60).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(p.read_log()[-4000:])


def run_cases(url: str, vocab: int, max_len: int) -> list:
    out = []
    for n in LENGTHS:  # warm-up (kernels compile; prefix caches get these, not the measured prompts)
        if n < max_len - 40:
            ask(url, {"prompt": prompt(n, 99, vocab), "max_tokens": 4, "temperature": 0})
    for i, n in enumerate(x for x in LENGTHS if x < max_len - 40):
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            c = ask(url, {"prompt": prompt(n, i, vocab), "max_tokens": 24, "logprobs": 2, **sampling})["choices"][0]
            out.append((n, sampling, c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
                        c["logprobs"]["top_logprobs"]))
    return out


@pytest.fixture(scope="module")
def dummy_8b(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama3-8b")
    subprocess.run([sys.executable, "-m", "benchmarks.dummy_model", "--shape", "llama3-8b", "--out", str(out)],
                   check=True)
    return out


@pytest.fixture(scope="module")
def dummy_moe_fp8(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-30b-a3b-fp8")
    subprocess.run([sys.executable, "-m", "benchmarks.dummy_model", "--shape", "qwen3-30b-a3b", "--fp8", "block",
                    "--layers", "8", "--out", str(out)], check=True)
    return out


@pytest.mark.parametrize("model,transport,step_budget,decode_gpu", [
    ("default", "ipc", None, 0), ("default", "ipc", 256, 0), ("llama3-8b", "ipc", None, 0),
    ("llama3-8b", "ipc", 512, 0), ("qwen3-moe-fp8", "ipc", None, 0), ("qwen3-moe-fp8", "ipc", 512, 0),
    pytest.param("default", "nixl", None, 0, marks=NIXL),
    pytest.param("llama3-8b", "ipc", 512, 1, marks=TWO_GPUS), pytest.param("qwen3-moe-fp8", "ipc", 512, 1, marks=TWO_GPUS),
    pytest.param("default", "nixl", 256, 1, marks=[NIXL, TWO_GPUS])])
def test_pd_is_bitwise_collocated(model, transport, step_budget, decode_gpu, request, tmp_path):
    # compile-ahead changes no numbers, only start-up time: five engines start here, so it is off
    args = ["--served-model-name", "default", "--kv-cache-memory-bytes", KV_BYTES, "--no-compile-ahead"]
    if step_budget:  # prompts longer than this take several prefill steps
        args += ["--max-num-batched-tokens", str(step_budget)]
    vocab, max_len = 4096, 1024  # the default model (its config.json)
    if model == "llama3-8b":
        args += ["--model", str(request.getfixturevalue("dummy_8b")), "--load-format", "dummy",
                 "--max-model-len", "4096"]
        vocab, max_len = 32000, 4096
    elif model == "qwen3-moe-fp8":
        fp8_gpu_dtype()
        args += ["--model", str(request.getfixturevalue("dummy_moe_fp8")), "--load-format", "dummy",
                 "--max-model-len", "4096", "--kv-cache-dtype", "fp8"]
        vocab, max_len = 151936, 4096
    colloc = ServerProcess(tmp_path / "collocated.log", args)
    try:
        wait_serving(colloc)
        expected = run_cases(colloc.url, vocab, max_len)
    finally:
        colloc.stop()
    for mode in ("read", "write"):
        # registry + two instances of HTTP, KV handshake, KV data: a block of its own, not the default 30001
        pd = ServerProcess(tmp_path / f"pd-{mode}.log", ["--role", "disagg", "--prefill-gpus", "0", "--decode-gpus",
                                                         str(decode_gpu), "--kv-transport", transport, "--kv-mode",
                                                         mode, "--base-port", str(free_port_range(7)), *args])
        try:
            wait_serving(pd)
            got = run_cases(pd.url, vocab, max_len)
        finally:
            pd.stop()
        for g, e in zip(got, expected):
            assert g == e, (f"{model}, {transport}, {mode} mode, step budget {step_budget}, decode on {decode_gpu}, "
                            f"prompt of {e[0]} tokens, {e[1]}: PD differs from collocated")

"""GSM8K loglikelihood accuracy with FP8: the default model quantized at load (--quantization fp8)
with an FP8 KV cache, against the same model unquantized (CPU, float32 activations; or, with
`--eval-device cuda`, on the GPU in bfloat16, where the Triton FP8 kernels run).

Reference: the unquantized server's lm-eval `gsm8k_tandem_ll` accuracy on the same docs; FP8 must
be within ACC_TOL. The full task (1319 docs) is the criterion and is marked slow; a subset runs
the same check with a looser bound, as one flipped doc moves a small subset's accuracy a lot.
"""
from contextlib import contextmanager
from pathlib import Path

import pytest

from benchmarks.lm_eval.task_dir import write_task_dir
from tandem.engine.config import DEFAULT_MODEL_DIR
from tests.server.conftest import ServerProcess

TASK, METRIC = "gsm8k_tandem_ll", "acc,none"
ACC_TOL = 0.02
FP8_FLAGS = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]


# A GPU server takes a fixed KV cache, not a share of the GPU, so that other work can run beside it.
DEVICE_FLAGS = {"cpu": ["--device", "cpu", "--dtype", "float32"],
                "cuda": ["--device", "cuda", "--dtype", "bfloat16", "--kv-cache-memory-bytes", "2000000000"]}


@pytest.fixture
def device_flags(request) -> list[str]:
    return DEVICE_FLAGS[request.config.getoption("--eval-device", default="cpu")]


@contextmanager
def _server(extra: list[str], log_path: Path):
    """A server on the default model with `extra` flags; its URL while the block runs."""
    server = ServerProcess(log_path, ["--max-num-seqs", "16", *extra])
    try:
        yield server.wait_healthy().url
    finally:
        server.stop()


def gsm8k_ll_accuracy(extra: list[str], limit: int | None, tmp: Path) -> float:
    """lm-eval `local-completions` against a server started with `extra` flags."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(write_task_dir(tmp / "tasks")), include_defaults=False)
    with _server(extra, tmp / f"server{len(extra)}.log") as url:
        args = {"model": Path(DEFAULT_MODEL_DIR).name, "base_url": f"{url}/v1/completions",
                "tokenizer": DEFAULT_MODEL_DIR, "tokenizer_backend": "huggingface", "tokenized_requests": False,
                "num_concurrent": 8, "max_retries": 1}
        out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[TASK], limit=limit,
                                      batch_size=1, task_manager=tasks, bootstrap_iters=0)
    return out["results"][TASK][METRIC]


@pytest.mark.eval  # ~20 min on 2 CPU cores (4 on a GPU): run by hand (README), not in the default test command
@pytest.mark.timeout(7200)  # two servers over the task on CPU
@pytest.mark.parametrize("limit,tol", [pytest.param(None, ACC_TOL, id="full"), pytest.param(40, 0.05, id="subset40")])
def test_fp8_gsm8k_loglikelihood_close_to_unquantized(tmp_path, limit, tol, device_flags):
    base = gsm8k_ll_accuracy(device_flags, limit, tmp_path)
    fp8 = gsm8k_ll_accuracy(device_flags + FP8_FLAGS, limit, tmp_path)
    print(f"gsm8k_tandem_ll acc (limit={limit}): unquantized {base:.4f}, fp8 weights + fp8 KV {fp8:.4f}")
    assert abs(fp8 - base) <= tol, f"fp8 {fp8:.4f} vs unquantized {base:.4f} (tolerance {tol})"

"""lm-eval through the server scores exactly what lm-eval scores on the model itself.

Reference: lm-eval's own `hf` backend (transformers, float32, greedy) on the same folder,
engine/default_model. Server side: `python -m tandem.server` (no --model: the embedded default model)
queried by lm-eval's `local-completions` with string prompts (tokenized_requests=False), the
way benchmarks/lm_eval/README.md runs it. Tasks: benchmarks/lm_eval/tasks/ on a GSM8K subset.
"""
from pathlib import Path

import pytest

from benchmarks.lm_eval.task_dir import write_task_dir
from tandem.engine.config import DEFAULT_MODEL_DIR
from tests.server.conftest import ServerProcess

SERVED_NAME = Path(DEFAULT_MODEL_DIR).name
# (task, metric key, docs): enough docs for a non-trivial score, small enough for 2 CPU cores.
GENERATE = ("gsm8k_tandem", "exact_match,strict-match", 20)
LOGLIKELIHOOD = ("gsm8k_tandem_ll", "acc,none", 40)
# float32 on both sides; only the order of reductions differs (batched vs single sequences).
LOGLIKELIHOOD_ATOL = 1e-3


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """`python -m tandem.server` on the default model, on a free port; stopped (SIGTERM) at teardown."""
    log_path = tmp_path_factory.mktemp("lm-eval-server") / "server.log"
    server = ServerProcess(log_path, ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "16"])
    try:
        yield server.wait_healthy().url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    task_dir = write_task_dir(tmp_path_factory.mktemp("lm-eval-tasks"))
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _evaluate(backend: str, server_url: str, task_manager, task: str, limit: int) -> dict:
    """lm-eval as the README runs it, in-process: `local-completions` against the server, or
    `hf` on the same folder."""
    import lm_eval

    if backend == "server":
        model, model_args = "local-completions", {
            "model": SERVED_NAME, "base_url": f"{server_url}/v1/completions", "tokenizer": DEFAULT_MODEL_DIR,
            "tokenizer_backend": "huggingface", "tokenized_requests": False, "num_concurrent": 8,
            "max_retries": 1}
    else:
        model, model_args = "hf", {"pretrained": DEFAULT_MODEL_DIR, "dtype": "float32", "device": "cpu"}
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit, batch_size=1,
                                   task_manager=task_manager, log_samples=True, bootstrap_iters=0)


def _responses(result: dict, task: str) -> dict[int, list]:
    """doc_id -> the raw responses: [generated text], or one [(loglikelihood, is_greedy)] per choice."""
    return {s["doc_id"]: s["resps"] for s in result["samples"][task]}


def test_generate_until_matches_hf(server_url, task_manager):
    task, metric, limit = GENERATE
    server = _evaluate("server", server_url, task_manager, task, limit)
    hf = _evaluate("hf", server_url, task_manager, task, limit)
    server_score, hf_score = server["results"][task][metric], hf["results"][task][metric]
    server_texts, hf_texts = _responses(server, task), _responses(hf, task)
    assert len(server_texts) == len(hf_texts) == limit
    assert server_score == hf_score, f"{task} {metric}: server {server_score} != hf {hf_score}"
    # The default model scores ~2% on GSM8K, so equal scores say little: greedy text must match too.
    differing = {d: (server_texts[d][0][0], hf_texts[d][0][0]) for d in hf_texts
                 if server_texts[d][0][0] != hf_texts[d][0][0]}
    assert not differing, f"{task}: greedy generations differ (doc_id: (server, hf)): {differing}"


def test_loglikelihood_matches_hf(server_url, task_manager):
    task, metric, limit = LOGLIKELIHOOD
    server = _evaluate("server", server_url, task_manager, task, limit)
    hf = _evaluate("hf", server_url, task_manager, task, limit)
    server_ll, hf_ll = _responses(server, task), _responses(hf, task)
    assert len(server_ll) == len(hf_ll) == limit
    pairs = [(doc_id, float(s[0][0]), float(h[0][0]))
             for doc_id in hf_ll for s, h in zip(server_ll[doc_id], hf_ll[doc_id], strict=True)]
    doc_id, server_worst, hf_worst = max(pairs, key=lambda p: abs(p[1] - p[2]))
    assert abs(server_worst - hf_worst) < LOGLIKELIHOOD_ATOL, (
        f"{task}: loglikelihoods differ on doc {doc_id}: server {server_worst}, hf {hf_worst}")
    for key in (metric, "acc_norm,none"):
        server_score, hf_score = server["results"][task][key], hf["results"][task][key]
        assert server_score == hf_score, f"{task} {key}: server {server_score} != hf {hf_score}"
    score = server["results"][task][metric]
    assert 0 < score < 1, f"{task} {metric} = {score} on {limit} docs: a trivial score cannot show a difference"

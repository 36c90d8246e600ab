"""`server --data-parallel-size 2 --enable-expert-parallel`: two lockstep engine cores behind one
API, requests spread over them; a tiny Qwen3-MoE answers what one offline engine answers. When
one core dies the other must not hang in a collective: the whole server exits non-zero."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import NUM_BLOCKS, ServerProcess, pid_alive
from tests.ports import free_port_range

PROMPTS = [[5, 9, 33, 71], list(range(40, 70)), [7] * 13, [100, 3], [8, 8, 9]]


@pytest.fixture(scope="module")
def moe_model_dir(tiny_model_dir, tmp_path_factory):
    """Random tiny Qwen3-MoE with the tiny Llama's tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("tiny-moe")
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(out)
    return out


def test_data_parallel_expert_parallel_server(moe_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tandem.engine import LLM, SamplingParams

    ref = LLM(str(moe_model_dir), dtype="float32", device="cpu").generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    srv = ServerProcess.for_model(moe_model_dir, tmp_path / "dp.log", "--data-parallel-size", "2",
                                  "--enable-expert-parallel", "--all2all-backend", "a2a",
                                  "--master-port", str(free_port_range(1))).wait_healthy()
    try:
        def complete(prompt):
            r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json=dict(
                model="default", prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(complete, PROMPTS))
        tok = AutoTokenizer.from_pretrained(moe_model_dir)
        assert [o["choices"][0]["text"] for o in outs] == [tok.decode(r.token_ids, skip_special_tokens=True)
                                                           for r in ref]
        log = srv.read_log()
        assert "EngineCore-DP0" in log and "EngineCore-DP1" in log
        # Stats are summed over the ranks: twice one engine's KV blocks.
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        total = [line for line in metrics.splitlines() if line.startswith("tandem:kv_cache_total_blocks{")]
        assert total and float(total[0].split()[-1]) == 2 * NUM_BLOCKS, metrics
    finally:
        code = srv.stop()
    assert code == 0, srv.read_log()


def _engine_cores(srv: ServerProcess) -> list[int]:
    children = Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split()
    return [pid for pid in map(int, children)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_killed_data_parallel_rank_takes_the_server_down(moe_model_dir, tmp_path):
    srv = ServerProcess.for_model(moe_model_dir, tmp_path / "dp-kill.log", "--data-parallel-size", "2",
                                  "--enable-expert-parallel", "--master-port", str(free_port_range(1))).wait_healthy()
    try:
        cores = _engine_cores(srv)
        assert len(cores) == 2, cores
        os.kill(cores[1], signal.SIGKILL)
        code = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        srv.kill()
        pytest.fail(f"server still running 60 s after a DP engine core was killed:\n{srv.read_log()}")
    assert code != 0
    assert "engine core process EngineCore-DP1 died" in srv.read_log()
    deadline = time.monotonic() + 10
    while pid_alive(cores[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(cores[0]), "the surviving DP engine core outlived the server"

"""Expert parallelism on 2 GPUs (NCCL): lockstep data-parallel engines per dispatch/combine
backend (CUDA graphs where the backend allows them) and EP over TP ranks, against one GPU
without EP. Passed on 2x H200, 2026-11-23."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.engine.test_expert_parallel import PARAMS, PROMPTS, run_dp_ranks
from tests.engine.test_tensor_parallel import assert_same_generation
from tests.ports import free_port_range

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
COMMON = dict(block_size=16, dtype="float32", num_gpu_blocks_override=128, max_num_batched_tokens=64,
              max_num_seqs=8, cuda_graph_sizes=(1, 2, 4, 8), compile_ahead=False)


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = LLM(tiny_models["qwen3_moe"][0], device="cuda", **COMMON)
    out = llm.generate(PROMPTS, PARAMS)
    del llm
    return out


@pytest.mark.parametrize("backend,split", [
    ("naive", [[0, 1, 2, 3], []]), ("a2a", [[1], [0, 2, 3]]), ("ipc", [[0, 1, 2, 3], []]), ("ipc", [[1], [0, 2, 3]])])
def test_lockstep_dp_ep_gpu(tiny_models, reference, backend, split):
    kwargs = dict(model=tiny_models["qwen3_moe"][0], data_parallel_size=2, enable_expert_parallel=True,
                  all2all_backend=backend, expert_placement_strategy="round_robin", master_port=free_port_range(1),
                  device="auto", **COMMON)
    results = run_dp_ranks(kwargs, split)
    for r, idx in enumerate(split):
        for j, i in enumerate(idx):
            tokens, lps = results[r][0][f"{r}-{j}"]
            assert tokens == reference[i].token_ids
            want = torch.tensor([lp.logprobs for lp in reference[i].logprobs])
            assert torch.allclose(torch.tensor(lps), want, atol=1e-3)


def test_lockstep_dp_ep_async_gpu(tiny_models):
    """--async-scheduling on 2 lockstep GPUs (ipc backend, CUDA graphs), tokens against one GPU."""
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    path = tiny_models["qwen3_moe"][0]
    ref = LLM(path, device="cuda", async_scheduling=False, **COMMON).generate(PROMPTS, params)
    split = [[1], [0, 2, 3]]
    kwargs = dict(model=path, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="ipc",
                  master_port=free_port_range(1), device="auto", async_scheduling=True, **COMMON)
    results = run_dp_ranks(kwargs, split, params)
    for r, idx in enumerate(split):
        assert [results[r][0][f"{r}-{j}"][0] for j in range(len(idx))] == [ref[i].token_ids for i in idx]


def test_ep_over_tp_gpu(tiny_models, reference):
    llm = LLM(tiny_models["qwen3_moe"][0], device="cuda", tensor_parallel_size=2, enable_expert_parallel=True,
              master_port=free_port_range(1), **COMMON)
    try:
        out = llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.shutdown()
    for o, r in zip(out, reference):
        assert_same_generation(o, r, atol=1e-3)

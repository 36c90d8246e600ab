"""Expert parallelism on CPU (gloo): experts sharded over TP ranks, and over lockstep
data-parallel engines with each dispatch/combine backend that runs on CPU. Reference: the
same model in one process without EP (itself checked against HF elsewhere)."""
import pytest
import torch
import torch.multiprocessing as mp

from tandem.engine import LLM, SamplingParams
from tandem.engine.config import EngineConfig
from tests.engine.test_tensor_parallel import assert_same_generation
from tests.ports import free_port_range

PROMPTS = [[3, 17, 29], list(range(40, 75)), [9] * 11, [5, 6]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("arch,placement", [("qwen3_moe", "linear"), ("mixtral", "round_robin")])
def test_expert_parallel_over_tp_ranks(tiny_models, arch, placement):
    path = tiny_models[arch][0]
    ref = LLM(path, block_size=4).generate(PROMPTS, PARAMS)
    llm = LLM(path, block_size=4, tensor_parallel_size=2, enable_expert_parallel=True,
              expert_placement_strategy=placement, master_port=free_port_range(1))
    try:
        assert [m.mlp.w13.shape[0] for m in llm.engine.runner.model.model.layers if hasattr(m.mlp, "w13")][0] == \
            (8 if arch == "qwen3_moe" else 4) // 2
        out = llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.shutdown()
    for o, r in zip(out, ref):
        assert_same_generation(o, r)


def _dp_rank(rank: int, kwargs: dict, prompts: list[list[int]], results, params=PARAMS) -> None:
    from tandem.engine.core import EngineCore
    from tandem.engine.protocol import EngineRequest

    core = EngineCore(EngineConfig.create(**kwargs), dp_rank=rank)
    try:
        for i, p in enumerate(prompts):
            core.add_request(EngineRequest(f"{rank}-{i}", p, params))
        got, steps = {}, 0
        while core.has_unfinished_requests():
            for o in core.step():
                tokens, lps = got.setdefault(o.request_id, ([], []))
                tokens.extend(o.new_token_ids)
                lps.extend(lp.logprobs for lp in o.new_logprobs or [])
            steps += 1
        results[rank] = (got, steps)
    finally:
        core.shutdown()


def run_dp_ranks(kwargs: dict, split: list[list[int]], params: SamplingParams = PARAMS) -> dict:
    """One process per DP rank, rank r serving PROMPTS[i] for i in split[r]:
    {rank: ({request id: (tokens, logprobs)}, steps taken)}."""
    results = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dp_rank, args=(r, kwargs, [PROMPTS[i] for i in idx], results, params))
             for r, idx in enumerate(split)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results)


@pytest.mark.parametrize("backend,placement,split", [
    ("naive", "linear", [[0, 1, 2, 3], []]),  # rank 1 idle throughout: runs padding-only batches
    ("a2a", "round_robin", [[1], [0, 2, 3]]),  # uneven: one rank finishes its prefill first
    ("naive", "round_robin", [[0], [1], [], [2, 3]]),
])
def test_lockstep_data_parallel_expert_parallel(tiny_models, backend, placement, split):
    path = tiny_models["qwen3_moe"][0]
    ref = LLM(path, block_size=4).generate(PROMPTS, PARAMS)
    kwargs = dict(model=path, block_size=4, data_parallel_size=len(split), enable_expert_parallel=True,
                  all2all_backend=backend, expert_placement_strategy=placement, master_port=free_port_range(1),
                  max_num_batched_tokens=16, device="cpu")
    results = run_dp_ranks(kwargs, split)
    assert len({results[r][1] for r in range(len(split))}) == 1  # every rank took the same steps
    for r, idx in enumerate(split):
        got = results[r][0]
        assert len(got) == len(idx)
        for j, i in enumerate(idx):
            tokens, lps = got[f"{r}-{j}"]
            assert tokens == ref[i].token_ids
            assert torch.allclose(torch.tensor(lps), torch.tensor([lp.logprobs for lp in ref[i].logprobs]), atol=1e-4)


@pytest.mark.parametrize("split", [[[0, 1, 2, 3], []], [[1], [0, 2, 3]]])
def test_lockstep_dp_ep_async_scheduling(tiny_models, split):
    """--async-scheduling on lockstep ranks: a step may launch ahead on one rank while another
    prefills or idles; each step() still agrees once, so the collectives line up."""
    path = tiny_models["qwen3_moe"][0]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    ref = LLM(path, block_size=4, async_scheduling=False).generate(PROMPTS, params)
    kwargs = dict(model=path, block_size=4, data_parallel_size=len(split), enable_expert_parallel=True,
                  all2all_backend="naive", master_port=free_port_range(1), max_num_batched_tokens=16, device="cpu",
                  async_scheduling=True)
    results = run_dp_ranks(kwargs, split, params)
    assert len({results[r][1] for r in range(len(split))}) == 1
    for r, idx in enumerate(split):
        assert [results[r][0][f"{r}-{j}"][0] for j in range(len(idx))] == [ref[i].token_ids for i in idx]


def test_parallel_flag_errors(tiny_models):
    path = tiny_models["qwen3_moe"][0]
    with pytest.raises(ValueError, match="needs --enable-expert-parallel"):
        LLM(path, all2all_backend="naive")
    with pytest.raises(ValueError, match="unknown --all2all-backend"):
        LLM(path, enable_expert_parallel=True, all2all_backend="nccl")
    with pytest.raises(ValueError, match="server"):
        LLM(path, data_parallel_size=2)
    with pytest.raises(ValueError, match="--moe-experts aiter needs ROCm"):
        LLM(path, moe_experts="aiter")
    with pytest.raises(ValueError, match="not supported yet"):
        EngineConfig.create(data_parallel_size=2, tensor_parallel_size=2).parallel.validate(False)

"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 generate what a single process generates.
Reference: the same model at --tensor-parallel-size 1 (itself checked against HF elsewhere)."""

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.ports import free_port_range

PROMPTS = [[3, 17, 29], list(range(40, 75)), [9] * 11]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def assert_same_generation(out, ref, atol: float = 1e-4) -> None:
    """Same greedy tokens, and top logprobs within atol."""
    assert out.token_ids == ref.token_ids
    got = torch.tensor([lp.logprobs for lp in out.logprobs])
    want = torch.tensor([lp.logprobs for lp in ref.logprobs])
    assert torch.allclose(got, want, atol=atol)


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("qwen2", 2), ("qwen3_moe", 2), ("mixtral", 2), ("llama", 4)])
def test_tensor_parallel_matches_single_process(tiny_models, arch, tp):
    path = tiny_models[arch][0]
    ref = LLM(path, block_size=4).generate(PROMPTS, PARAMS)
    llm = LLM(path, block_size=4, tensor_parallel_size=tp, master_port=free_port_range(1), max_num_batched_tokens=16)
    try:
        out = llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.shutdown()
    for r, o in zip(ref, out):
        assert_same_generation(o, r)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tensor_parallel_async_scheduling(tiny_models, arch):
    """Async scheduling (the default) with TP=2: steps launched ahead send their input ids from
    rank 0's device to the other rank; tokens equal the single-process synchronous engine's,
    including a request that stops on a token."""
    path = tiny_models[arch][0]
    sync = LLM(path, block_size=4, async_scheduling=False)
    probe = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[probe.token_ids[5]]),
              SamplingParams(max_tokens=7, temperature=0.7, seed=3, ignore_eos=True)]
    ref = sync.generate(PROMPTS, params)
    llm = LLM(path, block_size=4, tensor_parallel_size=2, master_port=free_port_range(1), max_num_batched_tokens=16)
    try:
        assert llm.engine.async_scheduling
        launch, ahead = llm.engine.runner.launch, []
        llm.engine.runner.launch = lambda out, eos, prev=None, **kw: ahead.append(prev is not None) or launch(
            out, eos, prev, **kw)
        out = llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()
    assert [(o.token_ids, o.finish_reason) for o in out] == [(r.token_ids, r.finish_reason) for r in ref]
    assert ref[1].finish_reason == "stop" and sum(ahead) > 3

"""Tensor parallelism on GPUs (NCCL, CUDA graphs): the TP=2 engine's greedy path, re-scored by
Hugging Face on one GPU with teacher forcing, has the same logprobs (see test_gpu.py for why
logprobs along the path rather than identical tokens)."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.engine.test_gpu import PROMPTS, _hf_logprobs
from tests.ports import free_port_range

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tp2_matches_hf(tiny_models, arch):
    path, hf = tiny_models[arch]
    llm = LLM(path, device="cuda", compile_ahead=False, dtype="float32", tensor_parallel_size=2,
              master_port=free_port_range(1), num_gpu_blocks_override=256, max_num_batched_tokens=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))
    finally:
        llm.engine.shutdown()
    hf = hf.to("cuda")
    for prompt, out in zip(PROMPTS, outs):
        ours = torch.tensor([lp.logprobs[0] for lp in out.logprobs], device="cuda")
        assert torch.allclose(ours, _hf_logprobs(hf, prompt, out.token_ids), atol=5e-3)
    hf.to("cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tp2_async_scheduling_gpu(tiny_models, arch):
    """Async scheduling with TP=2 and CUDA graphs: input ids of steps launched ahead go from rank
    0's GPU to rank 1 over NCCL; tokens equal the synchronous TP=2 engine's (the same sums, so
    the same rounding; against one GPU see test_tp2_matches_hf)."""
    path = tiny_models[arch][0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(path, device="cuda", compile_ahead=False, dtype="float32", tensor_parallel_size=2,
                  master_port=free_port_range(1), num_gpu_blocks_override=256, max_num_batched_tokens=64,
                  async_scheduling=async_scheduling)
        try:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]

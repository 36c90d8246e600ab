"""FP8 on a GPU (`-m gpu`): tiny FP8 checkpoints, online FP8 and the FP8 KV cache through the engine
(Triton FP8 GEMMs, fp8 fused experts, fp8 paged attention, CUDA graphs) against HF float32 on the
dequantized weights. bf16 activations: a looser bound than the CPU tests' (tests/engine/test_fp8.py)."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.engine.fp8_writer import write_fp8_checkpoint
from tests.engine.test_fp8 import PROMPTS, _reference
from tests.fp8_gpu import fp8_gpu_dtype

KV_BYTES = 1 << 28  # each engine gets its own KV budget: earlier engines of the session still hold memory

pytestmark = pytest.mark.gpu
GPU_TOL = 0.15  # |logprob| difference: bf16 activations and fp8 activations on top of the CPU test's error


def _check(llm: LLM, ref_model) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref_lp = ref_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for j in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[j].logprobs[0] - ref_lp[j - 1, prompt[j]].item()) < GPU_TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["hf_block", "ct_channel"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_engine_gpu(tiny_models, tmp_path, arch, fmt, kv):
    fp8_gpu_dtype()
    src = tiny_models[arch][0]
    tensors = write_fp8_checkpoint(src, tmp_path / "fp8", fmt)
    # no prefix caching: the decode comparison below must not start from a cached prefill (its
    # last block recomputed alone: another batch shape) in one engine and a full one in the other
    llm = LLM(str(tmp_path / "fp8"), device="cuda", compile_ahead=False, dtype="bfloat16", block_size=16, kv_cache_dtype=kv,
              kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False)
    _check(llm, _reference(tmp_path, src, tensors))
    # decode steps (CUDA graphs, skinny tiles) agree with eager decode
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(str(tmp_path / "fp8"), device="cuda", compile_ahead=False, dtype="bfloat16", block_size=16, kv_cache_dtype=kv,
                kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in eager.generate(PROMPTS, params)]


def test_online_fp8_and_dummy_gpu(tiny_models, tmp_path):
    fp8_gpu_dtype()
    src = tiny_models["qwen3_moe"][0]
    tensors = write_fp8_checkpoint(src, tmp_path / "same", "ct_channel")
    llm = LLM(src, device="cuda", compile_ahead=False, dtype="bfloat16", quantization="fp8", kv_cache_memory_bytes=KV_BYTES)
    _check(llm, _reference(tmp_path, src, tensors))
    dummy = LLM(str(tmp_path / "same"), device="cuda", compile_ahead=False, dtype="bfloat16", load_format="dummy",
                kv_cache_memory_bytes=KV_BYTES)
    assert len(dummy.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch,ep", [("llama", False), ("qwen3_moe", True)])
def test_fp8_tensor_and_expert_parallel_gpu(tiny_models, tmp_path, arch, ep):
    """A block-scaled FP8 checkpoint on 2 GPUs (NCCL): --tensor-parallel-size 2, the experts sharded
    over the ranks with --enable-expert-parallel (the FP8 grouped experts of an expert-parallel step),
    CUDA graphs at decode. Prompt logprobs against HF on the dequantized weights, and greedy tokens
    against HF wherever its top-2 margin clears twice the tolerance."""
    from tests.engine.test_fp8 import _greedy_with_margin
    from tests.ports import free_port_range
    fp8_gpu_dtype()
    src = tiny_models[arch][0]
    tensors = write_fp8_checkpoint(src, tmp_path / "fp8", "hf_block")
    ref = _reference(tmp_path, src, tensors)
    llm = LLM(str(tmp_path / "fp8"), device="cuda", compile_ahead=False, dtype="bfloat16", block_size=16,
              kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2, enable_expert_parallel=ep,
              master_port=free_port_range(1))
    try:
        _check(llm, ref)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        tokens, margin, _ = _greedy_with_margin(ref, prompt, 8)
        if margin > 2 * GPU_TOL:
            assert out.token_ids == tokens, f"top-2 margin {margin:.3f}"

"""The GPU path (Triton kernels, CUDA graphs) against Hugging Face on the same GPU.

Random tiny models have flat distributions, so instead of demanding identical greedy tokens
(a tf32 rounding can flip a near tie) the engine's own greedy path is re-scored by HF with
teacher forcing and every chosen token's logprob must agree.
"""
import pytest
import torch

from tandem.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 17, 29], list(range(40, 140)), [9] * 37, [5]]
KV_BYTES = 256 << 20


def _hf_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        lp = model(ids).logits[0].float().log_softmax(-1)
    return torch.stack([lp[len(prompt) + i - 1, t] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_engine_matches_hf(tiny_models, arch, enforce_eager):
    path, hf = tiny_models[arch]
    hf = hf.to("cuda")
    llm = LLM(path, device="cuda", compile_ahead=False, dtype="float32", block_size=16, enforce_eager=enforce_eager,
              max_num_batched_tokens=64, kv_cache_memory_bytes=KV_BYTES)
    assert (llm.engine.runner.graphs is None) == enforce_eager
    # a given KV size replaces the free-memory budget, so tests sharing the device do not collide
    assert llm.engine.blocks.num_blocks == KV_BYTES // llm.engine.runner.kv_bytes_per_block()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        ours = torch.tensor([lp.logprobs[0] for lp in out.logprobs], device="cuda")
        theirs = _hf_logprobs(hf, prompt, out.token_ids)
        assert torch.allclose(ours, theirs, atol=5e-3), (ours - theirs).abs().max()
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    hf.to("cpu")


def test_cuda_graph_and_eager_agree_bf16(tiny_models):
    path = tiny_models["llama"][0]
    prompts = [list(range(i, i + 20 + 7 * i)) for i in range(1, 30)]  # 29 sequences: padded to 32
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graph = LLM(path, device="cuda", compile_ahead=False, dtype="bfloat16", kv_cache_memory_bytes=KV_BYTES).generate(prompts, params)
    eager = LLM(path, device="cuda", compile_ahead=False, dtype="bfloat16", enforce_eager=True,
                kv_cache_memory_bytes=KV_BYTES).generate(prompts, params)
    same = sum(g.token_ids == e.token_ids for g, e in zip(graph, eager))
    assert same >= len(prompts) - 2  # identical math; bf16 ties may differ at most rarely


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_pending_norms_as_close_to_hf_as_norm_launches(tiny_models, arch):
    """bf16 decode with each RMSNorm carried by the GEMMs around it (KernelConfig.fuse_norms)
    against HF in float32: the teacher-forced logprobs of the run's own greedy tokens are no
    further from HF's than those of a run with a launch per norm (a dropped 1/rms, residual or
    weight moves them by whole units)."""
    path, hf = tiny_models[arch]
    hf = hf.to("cuda")
    err = {}
    for fold in (False, True):
        llm = LLM(path, device="cuda", compile_ahead=False, dtype="bfloat16", kv_cache_memory_bytes=KV_BYTES, fuse_norms=fold)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))
        err[fold] = max(
            (torch.tensor([lp.logprobs[0] for lp in out.logprobs], device="cuda")
             - _hf_logprobs(hf, prompt, out.token_ids)).abs().max().item()
            for prompt, out in zip(PROMPTS, outs))
        del llm
    hf.to("cpu")
    print(f"{arch}: max |logprob - HF fp32|, norm launches {err[False]:.4f}, carried {err[True]:.4f}")
    assert err[True] <= 2 * err[False] + 0.02, err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_engines_on_two_gpus_in_one_process(tiny_models):
    """An engine on cuda:1 after one on cuda:0 in the same process (test harnesses, notebooks)
    captures its graphs on its own GPU: torch's default capture stream, made once on the device
    current at the first capture, once moved every launch of the second engine to cuda:0 (Triton
    refused its cuda:1 tensors)."""
    path = tiny_models["llama"][0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = [LLM(path, device=f"cuda:{i}", compile_ahead=False, dtype="float32", block_size=16,
                kv_cache_memory_bytes=KV_BYTES).generate(PROMPTS, params) for i in (0, 1)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]

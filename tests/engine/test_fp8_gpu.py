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



WIDE_TOL = 2 * GPU_TOL  # hidden 4096: the CPU reference path itself is up to 0.16 off HF at this width


def _assert_decode_logprobs(ref, prompts, outs, eager: bool) -> None:
    """Every decode step's logprob of the token it chose within WIDE_TOL of ref (HF on the dequantized weights)
    fed the same tokens."""
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            lp = ref(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
        for j in range(1, len(out.token_ids)):  # (token 0 comes from the prefill)
            want = lp[len(prompt) + j - 1, out.token_ids[j]].item()
            assert abs(out.logprobs[j].logprobs[0] - want) < WIDE_TOL, (eager, j)


def _llama_8b_attention(tmp_path, intermediate: int):
    """A two-layer Llama with Llama-3-8B's attention (hidden 4096, 32 q heads, 8 KV heads of 128), random weights,
    written block-scaled FP8 ((128, 128) blocks) to tmp_path / "fp8"; returns HF on the dequantized weights."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=intermediate,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "src")
    tensors = write_fp8_checkpoint(str(tmp_path / "src"), tmp_path / "fp8", "hf_block", block=(128, 128))
    return _reference(tmp_path, str(tmp_path / "src"), tensors)


@pytest.mark.parametrize("ring", [False, True])
def test_fp8_tma_o_projection_gpu(tmp_path, monkeypatch, ring):
    """--fp8-tma-gemm --fp8-tma-early (kernels/triton/fp8_tma.py) on a two-layer Llama with Llama-3-8B's attention
    ((128, 128) blocks; its o projection takes that GEMM, let in early by the merge), with the ring fields off, and
    (ring) the defaults: also --fp8-tma-ring --fp8-tma-ring-normed --fp8-tma-ring-early, the down projection on the
    ring form from the SiLU-and-mul's quantized rows, gate_up from the pending norm's, each let in early, in 1-row
    decode steps (RING_MAX_ROWS): every decode step's logprob of the token it chose, in CUDA
    graphs and eager, against HF on the dequantized weights fed the same tokens; the graphs' tokens equal eager's;
    with compile-ahead, no variant of the GEMMs or of the merge compiles while the eager engine decodes."""
    from collections import Counter

    from tandem.engine.layers import attention
    from tandem.kernels.compile_watch import WATCH
    from tandem.kernels.triton import fp8_tma
    fp8_gpu_dtype()
    calls, rings, earlies = [], [], []
    launch, ring_launch, attend = fp8_tma.fp8_tma_linear, fp8_tma.fp8_tma_ring_linear, attention.paged_attention
    monkeypatch.setattr(fp8_tma, "fp8_tma_linear", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(fp8_tma, "fp8_tma_ring_linear",
                        lambda *a, **k: rings.append("norm_in" in k) or ring_launch(*a, **k))
    monkeypatch.setattr(attention, "paged_attention",
                        lambda *a, early, **k: earlies.append(early) or attend(*a, early=early, **k))
    # ring, intermediate 512: gate_up (1024 x 4096) on a Triton plan that quantizes ahead (1024's takes a plan
    # that quantizes in the GEMM), down (4096 x 512) on the ring's rule
    ref = _llama_8b_attention(tmp_path, 512 if ring else 1024)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    tokens = {}
    for eager in (True, False):  # eager first: no variant compiled in this process before its compile-ahead
        llm = LLM(str(tmp_path / "fp8"), device="cuda", compile_ahead=eager, dtype="bfloat16", block_size=16,
                  kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, enforce_eager=eager,
                  max_model_len=512, max_num_seqs=1 if ring else 16,  # (ring: its 1-row decode steps)
                  max_num_batched_tokens=512,  # (a short compile-ahead)
                  fp8_tma_ring=ring, fp8_tma_ring_normed=ring, fp8_tma_ring_early=ring)
        calls.clear(), rings.clear(), earlies.clear()
        compiled = Counter(WATCH.by_kernel)
        outs = llm.generate(PROMPTS, params)
        assert (calls and any(earlies)) or not eager  # (graphs captured the launches at start-up)
        assert not eager or set(rings) == ({False, True} if ring else set())  # down and gate_up on the ring
        late = {k for k in Counter(WATCH.by_kernel) - compiled if "fp8_tma" in k or "merge_splits" in k}
        assert not (eager and late), f"compile-ahead missed {late}"
        tokens[eager] = [o.token_ids for o in outs]
        _assert_decode_logprobs(ref, PROMPTS, outs, eager)
    assert tokens[False] == tokens[True]


@pytest.mark.parametrize("variant", ["ring", "fold", "fused"])
def test_fp8_ring_experts_gpu(tmp_path, monkeypatch, variant):
    """--fp8-tma-ring-moe (kernels/triton/fp8_tma.py fp8_tma_ring_experts) on a two-layer Qwen3-MoE with
    Qwen3-30B-A3B's expert shapes (hidden 2048, 768 an expert, top 8; 16 experts) and (128, 128) blocks, in 1-row
    decode steps: every decode step's logprob of the token it chose, in CUDA graphs and eager, against HF on the
    dequantized weights fed the same tokens; the graphs' tokens equal eager's; eager decode ran the ring experts,
    and over the 300-token prompt (contexts the attention splits) the o projection's TMA GEMM merging the
    attention's split-K partials (--fp8-tma-merge: its 8 MiB weight is not let in early); fold
    (--fp8-tma-ring-moe-fold): that GEMM also wrote the router GEMM's partials in every 1-row step, so no routing
    launch ran in those steps; fused (--fp8-tma-ring-moe-fused): w13 and w2 as one launch
    (kernels/triton/fp8_tma_moe.py) in every 1-row step, the two-launch form in none."""
    import transformers

    from tandem.kernels.linear import SplitPartials
    from tandem.kernels.triton import fp8_tma, fp8_tma_moe, routing
    fp8_gpu_dtype()
    fold, fused = variant == "fold", variant == "fused"
    calls, merged, routes, folded, fused_calls = [], [], [], [], []
    launch, o_launch, route = fp8_tma.fp8_tma_ring_experts, fp8_tma.fp8_tma_linear, routing.route_token_triton
    fused_launch = fp8_tma_moe.fp8_tma_fused_experts
    monkeypatch.setattr(fp8_tma, "fp8_tma_ring_experts", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(fp8_tma_moe, "fp8_tma_fused_experts",
                        lambda *a, **k: fused_calls.append(1) or fused_launch(*a, **k))
    monkeypatch.setattr(fp8_tma, "fp8_tma_linear", lambda x, *a, **k: merged.append(isinstance(x, SplitPartials))
                        or folded.append(k.get("router") is not None) or o_launch(x, *a, **k))
    monkeypatch.setattr(routing, "route_token_triton", lambda *a, **k: routes.append(1) or route(*a, **k))
    prompts = PROMPTS + [[int(t) for t in torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(5))]]
    cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, intermediate_size=768,
                                      moe_intermediate_size=768, num_experts=16, num_experts_per_tok=8,
                                      norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                                      architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "src")
    tensors = write_fp8_checkpoint(str(tmp_path / "src"), tmp_path / "fp8", "hf_block", block=(128, 128))
    ref = _reference(tmp_path, str(tmp_path / "src"), tensors)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path / "fp8"), device="cuda", compile_ahead=False, dtype="bfloat16", block_size=16,
                  kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, enforce_eager=eager,
                  max_model_len=512, max_num_seqs=1, max_num_batched_tokens=512, fp8_tma_ring_moe_fold=fold,
                  fp8_tma_ring_moe_fused=fused)
        calls.clear(), merged.clear(), routes.clear(), folded.clear(), fused_calls.clear()
        outs = llm.generate(prompts, params)
        assert ((calls or fused_calls) and any(merged)) or not eager  # (graphs captured the launches at start-up)
        assert not eager or (bool(fused_calls) == fused and bool(calls) != fused)
        # fold: the steps whose o projection merges the partials route in it, the others in a routing launch
        assert not eager or (any(folded) == fold and (len(routes) < len(calls)) == fold)
        tokens[eager] = [o.token_ids for o in outs]
        _assert_decode_logprobs(ref, prompts, outs, eager)
    assert tokens[False] == tokens[True]


def test_fp8_attention_wgmma_gpu(tmp_path, monkeypatch):
    """--fp8-attention-wgmma (kernels/triton/attention_wgmma.py) on a two-layer Llama with Llama-3-8B's attention
    over an fp8 KV cache, 24 sequences decoding together (24 x 8 KV heads fill an H100's or H200's 132 SMs, so the
    batch takes it; rope and the cache store fused into it): every decode step's logprob of the token
    it chose, in CUDA graphs and eager, against HF on the dequantized weights fed the same tokens (WIDE_TOL, as
    the other tests on this model); the graphs' tokens equal eager's."""
    from tandem.kernels.triton import attention_wgmma
    fp8_gpu_dtype()
    calls = []
    launch = attention_wgmma.decode_attention_wgmma
    monkeypatch.setattr(attention_wgmma, "decode_attention_wgmma", lambda *a, **k: calls.append(1) or launch(*a, **k))
    ref = _llama_8b_attention(tmp_path, 512)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(5, 90, (24,), generator=g)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path / "fp8"), device="cuda", dtype="bfloat16", block_size=16, kv_cache_dtype="fp8",
                  kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, enforce_eager=eager, max_model_len=512,
                  max_num_seqs=32, fp8_attention_wgmma=True)
        calls.clear()
        outs = llm.generate(prompts, params)
        assert calls or not eager  # (graphs captured the launches at start-up)
        tokens[eager] = [o.token_ids for o in outs]
        _assert_decode_logprobs(ref, prompts, outs, eager)
    assert tokens[False] == tokens[True]

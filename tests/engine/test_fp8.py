"""FP8 checkpoints through the normal loader, online FP8 and the FP8 KV cache (CPU reference path).

Reference: Hugging Face transformers (float32) running the *dequantized* weights of the same FP8
checkpoint (tests/engine/fp8_writer.py writes both). Our engine also quantizes activations per
token (group), so logprobs agree within LOGPROB_TOL, not bit for bit; greedy tokens must be
identical wherever the reference's top-2 logit margin exceeds 2 * LOGPROB_TOL at every step.
"""
import json
import multiprocessing
import shutil
import threading
import time

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tandem.engine import LLM, SamplingParams
from tests.engine.fp8_writer import FORMATS, write_fp8_checkpoint
from tests.ports import free_port_range

ARCHS = ["llama", "qwen3", "qwen3_moe", "mixtral"]
LOGPROB_TOL = 0.05  # |logprob(engine, fp8 activations) - logprob(HF, dequantized weights)|
GEN = 8
PROMPTS = [[7, 19, 3, 88, 140], [int(t) for t in torch.randint(3, 300, (23,), generator=torch.Generator().manual_seed(3))]]


def _reference(tmp_path, src: str, tensors: dict):
    ref = tmp_path / "reference"
    shutil.copytree(src, ref)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()


def _greedy_with_margin(model, prompt: list[int], n: int) -> tuple[list[int], float, torch.Tensor]:
    ids = list(prompt)
    margin = float("inf")
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = logits.topk(2).values
        margin = min(margin, (top[0] - top[1]).item())
        ids.append(int(logits.argmax()))
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return ids[len(prompt):], margin, logprobs


def _model_of(llm: LLM):
    return llm.engine.runner.model


def _check_against(llm: LLM, ref_model) -> None:
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, margin, ref_lp = _greedy_with_margin(ref_model, prompt, GEN)
        for j in range(1, len(prompt)):
            lp, row = out.prompt_logprobs[j], ref_lp[j - 1]
            assert abs(lp.logprobs[0] - row[prompt[j]].item()) < LOGPROB_TOL, (j, lp.logprobs[0], row[prompt[j]])
            assert torch.allclose(torch.tensor(lp.logprobs[1:]), row.topk(3).values, atol=LOGPROB_TOL)
        if margin > 2 * LOGPROB_TOL:
            assert out.token_ids == ref_tokens, f"top-2 margin {margin:.3f}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_matches_dequantized_reference(tiny_models, tmp_path, arch, fmt):
    src = tiny_models[arch][0]
    ignore = ("model.layers.1.self_attn.o_proj",)  # an unquantized layer named in the config stays bf16
    tensors = write_fp8_checkpoint(src, tmp_path / "fp8", fmt, ignore=ignore)
    llm = LLM(str(tmp_path / "fp8"), block_size=4, max_num_batched_tokens=16)
    model = _model_of(llm)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float32
    mlp = model.model.layers[0].mlp
    if hasattr(mlp, "w13"):
        assert mlp.w13.dtype == torch.float8_e4m3fn and mlp.gate.weight.dtype == torch.float32
    _check_against(llm, _reference(tmp_path, src, tensors))


def test_block_scales_fold_and_shard_alignment(tiny_models, tmp_path):
    """Block scales of 16 rows: fused q/k/v (128 + 64 + 64 rows) fold back into blocks."""
    tensors = write_fp8_checkpoint(tiny_models["qwen3"][0], tmp_path / "fp8", "hf_block", block=(16, 32))
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    qkv = _model_of(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_block == (16, 32) and qkv.weight_scale.shape == (16, 2)  # (128 + 64 + 64) / 16 rows
    _check_against(llm, _reference(tmp_path, tiny_models["qwen3"][0], tensors))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_online_fp8_matches_dequantized_reference(tiny_models, tmp_path, arch):
    """--quantization fp8 on a float checkpoint: per-channel weights, the reference dequantizes
    the same per-channel quantization of the checkpoint."""
    src = tiny_models[arch][0]
    tensors = write_fp8_checkpoint(src, tmp_path / "same", "ct_channel")  # only for its reference weights
    llm = LLM(src, block_size=4, quantization="fp8")
    assert _model_of(llm).model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    _check_against(llm, _reference(tmp_path, src, tensors))


def test_dummy_load_with_fp8_config(tiny_models, tmp_path):
    write_fp8_checkpoint(tiny_models["qwen3_moe"][0], tmp_path / "fp8", "hf_block")
    (tmp_path / "fp8" / "model.safetensors").unlink()  # no weights at all
    llm = LLM(str(tmp_path / "fp8"), load_format="dummy", block_size=4)
    model = _model_of(llm)
    w = model.model.layers[0].self_attn.qkv_proj
    assert w.weight.dtype == torch.float8_e4m3fn
    assert 0.01 < (w.weight.float() * w.weight_scale.repeat_interleave(w.fp8_block[0], 0)
                   .repeat_interleave(w.fp8_block[1], 1)[:, :w.weight.shape[1]]).std() < 0.03
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_fp8_kv_cache_close_to_reference(tiny_models):
    """--kv-cache-dtype fp8: the KV cache is e4m3 (half the bytes of bf16) and logprobs stay close
    to HF float32 (the tiny models' K/V are far inside e4m3's range at scale 1.0)."""
    path, model = tiny_models["qwen3"]
    llm = LLM(path, block_size=4, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_bytes_per_block() * 4 == LLM(path, block_size=4).engine.runner.kv_bytes_per_block()  # vs fp32
    _check_against(llm, model)


def test_unsupported_quantization_is_a_clear_error(tiny_models, tmp_path):
    src = tiny_models["llama"][0]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="awq"):
        LLM(str(dst))
    with pytest.raises(ValueError, match="--quantization"):
        LLM(src, quantization="int4")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # head_dim 16 / 32: the weights' 32-column groups
def test_norms_and_activation_quantize_for_the_fp8_gemm_after(tiny_models, tmp_path, monkeypatch, arch):
    """At 17-64 rows (KernelConfig.fuse_fp8_quant) the norms ahead of qkv_proj / gate_up_proj, the
    attention ahead of o_proj and the activation ahead of down_proj write the FP8 GEMM's input
    quantized (kernels.fp8.QuantRows; the attention where a group is one head: qwen3's). The
    values are those the GEMM's own quantization writes, so on the CPU references the logprobs and
    tokens are bitwise those of the unfused path; and the fused forms did run (counted)."""
    import tandem.engine.layers.activation as act_layers
    import tandem.engine.layers.attention as attn_layers
    import tandem.engine.layers.norm as norm_layers
    src = tiny_models[arch][0]
    write_fp8_checkpoint(src, tmp_path / "fp8", "hf_block")
    calls = {"norm": 0, "act": 0, "attn": 0}

    def counted(name, fn, when=lambda *args: True):
        def run(*args, **kwargs):
            calls[name] += when(*args)
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(norm_layers, "rms_norm_quant", counted("norm", norm_layers.rms_norm_quant))
    monkeypatch.setattr(act_layers, "silu_and_mul_quant", counted("act", act_layers.silu_and_mul_quant))
    monkeypatch.setattr(attn_layers, "paged_attention", counted("attn", attn_layers.paged_attention,
                                                                lambda *args: args[-1] is not None))
    prompt = [int(t) for t in torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = {}
    for fuse in (True, False):
        llm = LLM(str(tmp_path / "fp8"), block_size=4, max_num_batched_tokens=64, fuse_fp8_quant=fuse)
        layers = len(_model_of(llm).model.layers)
        outs[fuse] = llm.generate([prompt, prompt[:30]], params)
        if fuse:  # the first step's 64 rows (40 + 24 prompt tokens) took the fused forms, every layer
            assert calls["norm"] >= 2 * layers and calls["act"] >= layers, calls
            assert calls["attn"] >= layers if arch == "qwen3" else calls["attn"] == 0, calls
            seen = dict(calls)
        else:
            assert calls == seen, "fuse_fp8_quant=False ran a fused form"
        del llm
    for fused, plain in zip(outs[True], outs[False]):
        assert fused.token_ids == plain.token_ids
        for a, b in zip(fused.prompt_logprobs[1:], plain.prompt_logprobs[1:]):
            assert a.logprobs == b.logprobs and a.token_ids == b.token_ids


@pytest.mark.parametrize("arch,fmt,ep", [("llama", "hf_block", False), ("qwen3_moe", "hf_block", True),
                                         ("qwen3_moe", "ct_channel", True), ("mixtral", "hf_block", True)])
def test_fp8_checkpoint_under_tensor_and_expert_parallel(tiny_models, tmp_path, arch, fmt, ep):
    """The seeds' kind of deployment on CPU (gloo): an FP8 checkpoint at --tensor-parallel-size 2,
    the experts sharded over the two ranks (--enable-expert-parallel), against HF on the dequantized
    weights, as the single-process tests above. Each rank holds half of every projection's rows (and
    their block scales), half of the row-parallel inputs, and half of the experts whole."""
    src = tiny_models[arch][0]
    tensors = write_fp8_checkpoint(src, tmp_path / "fp8", fmt)
    llm = LLM(str(tmp_path / "fp8"), block_size=4, tensor_parallel_size=2, enable_expert_parallel=ep,
              master_port=free_port_range(1))
    try:
        layer = _model_of(llm).model.layers[0]
        o = layer.self_attn.o_proj
        assert o.weight.dtype == torch.float8_e4m3fn and o.weight.shape[1] == 32  # half of the 64 input columns
        if ep:
            assert layer.mlp.w13.dtype == torch.float8_e4m3fn
            assert layer.mlp.w13.shape[0] == (8 if arch == "qwen3_moe" else 4) // 2  # half the experts, each whole
        _check_against(llm, _reference(tmp_path, src, tensors))
    finally:
        llm.engine.shutdown()


def test_fp8_block_not_dividing_a_rank_shard_is_a_clear_error(tiny_models, tmp_path):
    """A weight block wider than a rank's share of a row-parallel input (o_proj's 64 columns in 4
    ranks of 16, blocks of 32) cannot be split: the loader says so and which flag to change (rank 0's
    own error; workers that die of it first wait for it, engine/worker.py START_GRACE_S). The failed
    start leaves no worker process and no watchdog behind: one used to exit the host process (this
    test run) once the workers died of the same error, after the exception had been handled."""
    write_fp8_checkpoint(tiny_models["llama"][0], tmp_path / "fp8", "hf_block")
    with pytest.raises(Exception, match="use another --tensor-parallel-size"):
        LLM(str(tmp_path / "fp8"), block_size=4, tensor_parallel_size=4, master_port=free_port_range(1))
    assert not [p.name for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]
    time.sleep(1.0)  # (the watchdog polls every 0.5 s)
    assert "tp-watchdog" not in [t.name for t in threading.enumerate()]

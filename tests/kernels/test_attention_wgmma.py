"""kernels/triton/attention_wgmma.py, the decode attention on wgmma over an e4m3 cache (KernelConfig
fp8_attention_wgmma). Without a GPU: compiled for sm_90, its QK^T is an fp8 wgmma fed by TMA and its PV an f16
wgmma, at four programs an SM, with tiles requested before the PDL wait. On a GPU: against kernels.attention's
reference on the same cache, within 5e-3 and at most a quarter of the error q rounded to e4m3 once gives (the
launch takes q as two e4m3 parts, its rounding and the residual's), and the o projection's fp8 form equal to the
plain output quantized by kernels.fp8.quantize_rows; with rope fused, the
caches and output as rotary_store_kvcache then the launch without rope leave them. The engine's test:
tests/engine/test_fp8_gpu.py::test_fp8_attention_wgmma_gpu."""
import re

import pytest
import torch

from tests.fp8_gpu import fp8_gpu_dtype
from tests.kernels.test_fp8 import _registers, _rel


def _compile(quant: bool, group: int = 4, stages: int = 2, rope: bool = False, qk_norm: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tandem.kernels.triton.attention_wgmma import MAXNREG, _cache_desc, _decode_attention_wgmma_kernel
    desc = _cache_desc(torch.empty(64, 16, 8, 128, dtype=torch.float8_e4m3fn)).__mangle__()
    ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", q8_ptr="*fp8e4nv", q8s_ptr="*fp32", block_tables_ptr="*i32",
                seq_lens_ptr="*i32", query_start_loc_ptr="*i32", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                k_new_ptr="*bf16", v_new_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32", slot_ptr="*i64",
                qw_ptr="*bf16", kw_ptr="*bf16", eps="fp32")
    ints = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_q8t", "stride_q8st",
            "stride_knt", "stride_knh", "stride_vnt", "stride_vnh", "stride_cs")
    consts = dict(GROUP=group, STAGES=stages, KV_MAX=448.0, QUANT_OUT=quant, PDL=True, ROPE=rope, QK_NORM=qk_norm,
                  ROT=128 if rope else 0, num_warps=4)
    sig = {"k_desc": desc, "v_desc": desc, **ptrs, "qk_scale": "fp32", "fp8_max": "fp32", **{n: "i32" for n in ints},
           **{n: "constexpr" for n in consts}}
    return triton.compile(GluonASTSource(_decode_attention_wgmma_kernel, sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))


@pytest.mark.parametrize("quant,group", [(False, 4), (True, 4), (True, 8)])
def test_compiles_to_an_fp8_wgmma_fed_by_tma(quant, group):
    compiled = _compile(quant, group)
    ptx = compiled.asm["ptx"]
    # S^T = K q8^T + K r8^T (q's two e4m3 parts, 4 steps of 32 each), K as the cache holds it
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3") == 2 * 4
    assert "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16" in ptx  # O^T += V^T P^T
    assert "mma.sync" not in ptx
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) >= 2  # each page of K and V by TMA
    assert ptx.index("cp.async.bulk.tensor") < ptx.index("griddepcontrol.wait")  # old keys' tiles before the wait
    # four programs an SM (a 64-sequence batch of 8 KV heads, 512 programs, in one wave on 132 SMs)
    assert _registers(compiled) <= 128 and compiled.metadata.shared <= 57 * 1024, (_registers(compiled),
                                                                                    compiled.metadata.shared)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_rope_compiles_with_every_tile_before_the_wait(qk_norm):
    """With rope fused (the program rotates q and the new key and stores the key and value), the new key comes
    from registers: every tile holds earlier keys only, so the first tiles are all requested before the PDL wait
    and none outside the loop after it; still four programs an SM."""
    compiled = _compile(True, 4, rope=True, qk_norm=qk_norm)
    ptx = compiled.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    loop = ptx.index("mbarrier.try_wait")  # the first tile's wait opens the loop
    assert "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3" in ptx
    assert ptx[:wait].count("cp.async.bulk.tensor") == 2 * 8  # two stages of four K and four V pages
    assert "cp.async.bulk.tensor" not in ptx[wait:loop]
    assert _registers(compiled) <= 128 and compiled.metadata.shared <= 57 * 1024, (_registers(compiled),
                                                                                    compiled.metadata.shared)


def _group_rounded(q: torch.Tensor, hk: int, dtype: torch.dtype) -> torch.Tensor:
    """q [T, Hq, D] rounded to e4m3 once (the launch's first part of q): one scale for each token's q heads of a KV
    head."""
    t, hq, d = q.shape
    g = q.float().view(t, hk, hq // hk * d)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / torch.finfo(dtype).max
    return ((g / scale).to(dtype).float() * scale).view(t, hq, d)


def _case(ctx: list[int], hk: int, hq: int, seed: int = 0):
    dtype = fp8_gpu_dtype()
    g = torch.Generator(device="cuda").manual_seed(seed)
    page, d, seqs = 16, 128, len(ctx)
    pages = -(-max(ctx) // page) + 1  # a spare column: the table is wider than the longest sequence
    k_cache = torch.randn(seqs * pages, page, hk, d, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(seqs * pages, page, hk, d, device="cuda", generator=g).to(dtype)
    q = torch.randn(seqs, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(seqs * pages, device="cuda", dtype=torch.int32, generator=g).view(seqs, pages)
    seq_lens = torch.tensor(ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, table, seq_lens, qsl


@pytest.mark.gpu
@pytest.mark.parametrize("hk,hq", [(8, 32), (4, 32), (2, 4)])
def test_matches_the_reference_on_a_decode_batch_gpu(hk, hq):
    """64 sequences of 1..400 keys (tiles cut inside a page and between pages), Llama-3-8B's and Qwen3-30B-A3B's
    heads, and a group of 2."""
    from tandem.kernels.attention import paged_attention_ref
    from tandem.kernels.triton.attention_wgmma import decode_attention_wgmma, supports
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma: Hopper")
    ctx = [1, 16, 63, 64, 65, 400] + torch.randint(1, 400, (58,), generator=torch.Generator().manual_seed(1)).tolist()
    q, kc, vc, table, seq_lens, qsl = _case(ctx, hk, hq)
    assert supports(q, kc, 1) == (hk * 64 >= torch.cuda.get_device_properties(0).multi_processor_count)
    out = decode_attention_wgmma(q, kc, vc, table, seq_lens, qsl, 128 ** -0.5)
    exact = paged_attention_ref(q, kc, vc, table, seq_lens, qsl, 128 ** -0.5)
    rounded = paged_attention_ref(_group_rounded(q, hk, kc.dtype).to(q.dtype), kc, vc, table, seq_lens, qsl,
                                  128 ** -0.5)
    # q's two e4m3 parts: far closer to the reference than q rounded to e4m3 once
    assert _rel(out, exact) < 5e-3 and _rel(out, exact) < 0.25 * _rel(rounded, exact), (_rel(out, exact),
                                                                                         _rel(rounded, exact))


@pytest.mark.gpu
def test_quantized_output_is_the_output_quantized_gpu():
    """QUANT_OUT: the o projection's fp8 input, as kernels.fp8.quantize_rows writes the plain output's rows."""
    from tandem.kernels.fp8 import quantize_rows
    from tandem.kernels.triton.attention_wgmma import decode_attention_wgmma
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma: Hopper")
    q, kc, vc, table, seq_lens, qsl = _case([5, 130, 333, 1000], 8, 32, seed=2)
    out = decode_attention_wgmma(q, kc, vc, table, seq_lens, qsl, 128 ** -0.5)
    q8, q8s = decode_attention_wgmma(q, kc, vc, table, seq_lens, qsl, 128 ** -0.5, quant=(kc.dtype, 128))
    ref8, ref_s = quantize_rows(out.flatten(1), kc.dtype, 128)
    assert torch.equal(q8.view(torch.uint8), ref8.view(torch.uint8)) and torch.equal(q8s, ref_s.view(q8s.shape))


@pytest.mark.gpu
@pytest.mark.parametrize("hk,hq,qk_norm", [(8, 32, False), (4, 32, True)])
def test_fused_rope_matches_the_separate_launch_gpu(hk, hq, qk_norm):
    """rope fused (NewTokens): the caches as rotary_store_kvcache leaves them (values bit for bit, keys within
    rounding: fp32 -> e4m3 either way) and the output as that launch then this one without rope gives it (the new
    key from registers, not from its tile), and near the reference; contexts
    where the new key is the only one, ends a tile, starts one, and sits inside one."""
    from tandem.kernels.attention import NewTokens, paged_attention_ref
    from tandem.kernels.rotary import build_cos_sin_cache, rotary_store_kvcache, rotary_store_kvcache_ref
    from tandem.kernels.triton.attention_wgmma import decode_attention_wgmma
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma: Hopper")
    ctx = [1, 2, 64, 65, 17, 400] + torch.randint(1, 400, (58,), generator=torch.Generator().manual_seed(3)).tolist()
    _, kc, vc, table, seq_lens, qsl = _case(ctx, hk, hq, seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(len(ctx), hq + 2 * hk, 128, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    positions = seq_lens.long() - 1
    slots = table[torch.arange(len(ctx), device="cuda"), positions // 16].long() * 16 + positions % 16
    cache = build_cos_sin_cache(1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)), 9000)
    norm = ((1 + 0.1 * torch.randn(128, device="cuda", generator=g)).to(torch.bfloat16),
            (1 + 0.1 * torch.randn(128, device="cuda", generator=g)).to(torch.bfloat16), 1e-6) if qk_norm else None
    kc1, vc1 = kc.clone(), vc.clone()
    q1 = rotary_store_kvcache(positions, q.clone(), k, v, cache, kc1, vc1, slots, norm)
    apart = decode_attention_wgmma(q1, kc1, vc1, table, seq_lens, qsl, 128 ** -0.5)
    kc2, vc2, q_before = kc.clone(), vc.clone(), q.clone()
    fused = decode_attention_wgmma(q, kc2, vc2, table, seq_lens, qsl, 128 ** -0.5,
                                   rope=NewTokens(positions, k, v, cache, slots, norm))
    assert torch.equal(vc2.view(torch.uint8), vc1.view(torch.uint8)) and torch.equal(q, q_before)
    assert _rel(kc2.float(), kc1.float()) < 1e-2
    assert _rel(fused, apart) < 5e-3, _rel(fused, apart)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = rotary_store_kvcache_ref(positions, q.clone(), k.clone(), v.clone(), cache, kc_ref, vc_ref, slots, norm)
    ref = paged_attention_ref(q_ref, kc_ref, vc_ref, table, seq_lens, qsl, 128 ** -0.5)
    assert _rel(fused, ref) < 5e-3, _rel(fused, ref)

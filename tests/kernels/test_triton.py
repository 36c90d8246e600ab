"""Triton kernels against their torch references on fresh random inputs (GPU only).

Reference for each test: the `*_ref` function of the same kernel family in `kernels/`.
Outputs the kernels allocate are poisoned by first filling the allocator's cached memory with NaN.
"""
import math

import pytest
import torch

from tandem.kernels.activation import silu_and_mul_ref
from tandem.kernels.attention import paged_attention_ref
from tandem.kernels.kv_cache import store_kvcache_ref
from tandem.kernels.moe import fused_experts_ref, topk_routing, topk_routing_ref
from tandem.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from tandem.kernels.rotary import apply_rotary_ref, build_cos_sin_cache, rotary_store_kvcache_ref
from tests.fp8_gpu import assert_codes_match

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}  # float32 dots run as tf32
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output (an element left unwritten?)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _poison(nbytes: int) -> None:
    """Leave NaN in the allocator's free blocks so that an unwritten output element shows up."""
    junk = [torch.full((nbytes // 4 + 1024,), float("nan"), device=DEVICE) for _ in range(4)]
    del junk


def _paged_inputs(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_tokens=0):
    blocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks) + 7
    perm = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(len(ctx_lens), max(blocks) + 2, dtype=torch.int32, device=DEVICE)
    used = 0
    for s, nb in enumerate(blocks):
        block_tables[s, :nb] = perm[used:used + nb].int()
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    q = torch.randn(sum(q_lens) + extra_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + list(q_lens), device=DEVICE).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens, qsl


ATTN_CASES = {
    # name: (q_lens, ctx_lens)
    "mixed": ([1, 37, 1, 100, 5, 1, 16, 4, 2], [1000, 37, 17, 300, 69, 16, 48, 900, 2]),
    "decode": ([1] * 6, [8200, 1, 15, 16, 17, 1029]),
    "long_decode": ([1], [9000]),
    "prefill": ([300, 129], [300, 129]),
    "chunked_long": ([64, 1], [8300, 4097]),
}


# every case with GQA 32/8 and 16/2 and plain MHA in bf16 and fp32 (head_dim 128 and 64); fp16 once
ATTN_PARAMS = [(case, heads, head_dim, dtype)
               for case in ATTN_CASES for heads in [(32, 8), (16, 2), (8, 8)]
               for head_dim, dtype in [(128, torch.bfloat16), (64, torch.float32)]]
ATTN_PARAMS += [("mixed", (32, 8), 128, torch.float16), ("decode", (16, 2), 64, torch.bfloat16)]


@pytest.mark.parametrize("case,heads,head_dim,dtype", ATTN_PARAMS)
def test_paged_attention(case, heads, head_dim, dtype):
    from tandem.kernels.triton.attention import paged_attention_triton
    q_lens, ctx_lens = ATTN_CASES[case]
    args = _paged_inputs(q_lens, ctx_lens, *heads, head_dim, 16, dtype)
    scale = 1 / math.sqrt(head_dim)
    ref = paged_attention_ref(*args, scale)
    for bounds in ((None, None), (max(q_lens), max(ctx_lens))):
        _poison(ref.numel() * 4 * 64)
        out = paged_attention_triton(*args, scale, *bounds)
        assert _rel(out, ref) < TOL[dtype], (case, bounds)


@pytest.mark.parametrize("heads,head_dim,dtype", [((32, 8), 128, torch.bfloat16), ((16, 2), 64, torch.float32),
                                                  ((8, 8), 128, torch.float16)])
def test_paged_attention_dense_prefill(heads, head_dim, dtype):
    """Fresh prefills (plus decodes) with dense_kv: keys and values of the prefills are read from
    the new rows. The cache blocks of the prefills are zeroed afterwards, so an output that still
    matches the reference can only have come from the rows."""
    from tandem.kernels.triton.attention import paged_attention_triton
    q_lens, ctx_lens = [300, 1, 129, 1, 2000], [300, 900, 129, 17, 2000]
    q, kc, vc, bt, seq_lens, qsl = _paged_inputs(q_lens, ctx_lens, *heads, head_dim, 16, dtype)
    ref = paged_attention_ref(q, kc, vc, bt, seq_lens, qsl, 0.1)
    rows = [(s, ctx - ql + j) for s, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)) for j in range(ql)]
    blk = torch.stack([bt[s, p // 16] for s, p in rows]).long()
    off = torch.tensor([p % 16 for _, p in rows], device=DEVICE)
    k_new, v_new = kc[blk, off], vc[blk, off]
    for s, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)):
        if ql > 1:
            kc[bt[s, :-(-ctx // 16)].long()] = 0
            vc[bt[s, :-(-ctx // 16)].long()] = 0
    _poison(q.numel() * 4)
    out = paged_attention_triton(q, kc, vc, bt, seq_lens, qsl, 0.1, 2000, 2000, dense_kv=(k_new, v_new))
    assert _rel(out, ref) < TOL[dtype]
    single = paged_attention_triton(q[:300], kc, vc, bt[:1], seq_lens[:1], qsl[:2], 0.1, 300, 300,
                                    dense_kv=(k_new[:300], v_new[:300]))  # one sequence: one launch
    assert _rel(single, ref[:300]) < TOL[dtype]


def test_paged_attention_odd_head_dim_and_group():
    from tandem.kernels.triton.attention import paged_attention_triton
    args = _paged_inputs([3, 1, 50], [40, 77, 50], 28, 4, 80, 32, torch.bfloat16)
    ref = paged_attention_ref(*args, 0.1)
    assert _rel(paged_attention_triton(*args, 0.1), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("heads,rot_fraction,qk_norm", [((32, 8), 1.0, True), ((16, 2), 0.5, False), ((8, 8), 1.0, False)])
def test_paged_attention_rope(heads, rot_fraction, qk_norm):
    """A decode batch whose q/k norm, rotation and KV store the attention launch does (NewTokens):
    output and cache against rotary_store_kvcache_ref then paged_attention_ref, with and without
    split-K (the split holding the new key stores it)."""
    from tandem.kernels.attention import NewTokens
    from tandem.kernels.triton.attention import paged_attention_triton
    q_lens, ctx_lens = ATTN_CASES["decode"]
    _, kc, vc, bt, seq_lens, qsl = _paged_inputs(q_lens, ctx_lens, *heads, 128, 16, torch.bfloat16)
    hq, hk = heads
    qkv = torch.randn(len(q_lens), hq + 2 * hk, 128, device=DEVICE).to(torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    positions = seq_lens.long() - 1
    slots = bt[torch.arange(len(q_lens), device=DEVICE), positions // 16].long() * 16 + positions % 16
    rot = int(128 * rot_fraction)
    cache = build_cos_sin_cache(1.0 / (1e6 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot)), 9000)
    norm = ((1 + 0.1 * torch.randn(128, device=DEVICE)).to(torch.bfloat16),
            (1 + 0.1 * torch.randn(128, device=DEVICE)).to(torch.bfloat16), 1e-6) if qk_norm else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = rotary_store_kvcache_ref(positions, q.clone(), k.clone(), v.clone(), cache, kc_ref, vc_ref, slots, norm)
    ref = paged_attention_ref(q_ref, kc_ref, vc_ref, bt, seq_lens, qsl, 0.08)
    q_before = q.clone()
    for bound in (max(ctx_lens), 16 * bt.shape[1]):
        kc2, vc2 = kc.clone(), vc.clone()
        out = paged_attention_triton(q, kc2, vc2, bt, seq_lens, qsl, 0.08, 1, bound,
                                     rope=NewTokens(positions, k, v, cache, slots, norm))
        assert _rel(out, ref) < TOL[torch.bfloat16] and _rel(kc2, kc_ref) < TOL[torch.bfloat16] / 4, bound
        assert torch.equal(vc2, vc_ref) and torch.equal(q, q_before)  # q is read, not rotated in place


@pytest.mark.parametrize("heads", [(32, 8), (32, 4)])  # Llama-3-8B's and Qwen3-30B-A3B's batch-1 plans
def test_paged_attention_rope_fp8_cache_kv_early(heads):
    """One decode over an e4m3 cache, rope fused, each program's last tile read before the PDL wait
    (kv_early) and the new key put into it from registers: output and cache against the same launch
    reading that key back from the cache (kv_early off), and both against rotary_store_kvcache_ref then
    paged_attention_ref; contexts whose new key ends a tile, starts one, and sits inside one. The same with that key
    read back into the tile from the cache and the tile taken first (KV_READBACK). And the launch prefetching that
    tile into L2 instead (KV_PREFETCH) against the one without kv_early, bit for bit."""
    from tandem.kernels.attention import NewTokens
    from tandem.kernels.fp8 import fp8_dtype, has_fp8_compute
    from tandem.kernels.triton.attention import _launch_plans, _paged_attention, paged_attention_triton
    if not has_fp8_compute(torch.device(DEVICE)):
        pytest.skip("no fp8 on this GPU")
    hq, hk = heads
    for ctx in (1024, 1025, 1000, 17):
        q, kc, vc, bt, seq_lens, qsl = _paged_inputs([1], [ctx], hq, hk, 128, 16, torch.bfloat16)
        assert [p.get("KV_EARLY") for p in _launch_plans(q, hq // hk, 1, hk, 1, 2048, kv_bytes=1)] == [True]
        kc, vc = (kc * 0.5).to(fp8_dtype(DEVICE)), vc.to(fp8_dtype(DEVICE))
        k, v = torch.randn(2, 1, hk, 128, device=DEVICE).to(torch.bfloat16).unbind(0)
        positions = seq_lens.long() - 1
        slots = bt[0, positions // 16].long() * 16 + positions % 16
        cache = build_cos_sin_cache(1.0 / (1e6 ** (torch.arange(0, 128, 2, device=DEVICE).float() / 128)), 9000)
        norm = ((1 + 0.1 * torch.randn(128, device=DEVICE)).to(torch.bfloat16),
                (1 + 0.1 * torch.randn(128, device=DEVICE)).to(torch.bfloat16), 1e-6)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q_ref = rotary_store_kvcache_ref(positions, q.clone(), k.clone(), v.clone(), cache, kc_ref, vc_ref, slots,
                                         norm)
        ref = paged_attention_ref(q_ref, kc_ref, vc_ref, bt, seq_lens, qsl, 0.08)
        outs, k_caches = {}, {}
        for kv_early in (True, False):
            kc2, vc2 = kc.clone(), vc.clone()
            outs[kv_early] = paged_attention_triton(q, kc2, vc2, bt, seq_lens, qsl, 0.08, 1, 2048,
                                                    rope=NewTokens(positions, k, v, cache, slots, norm),
                                                    kv_early=kv_early)
            assert _rel(outs[kv_early], ref) < TOL[torch.bfloat16], (ctx, kv_early)
            assert torch.equal(vc2.view(torch.uint8), vc_ref.view(torch.uint8)), (ctx, kv_early)
            k_caches[kv_early] = kc2.view(torch.uint8)
        assert torch.equal(k_caches[True], k_caches[False]), ctx
        assert _rel(outs[True], outs[False]) < 2e-3, ctx
        # KV_PREFETCH (that tile's rows prefetched into L2 before the wait instead, read after it): a hint only,
        # so the launch without kv_early bit for bit
        plan = {key: val for key, val in _launch_plans(q, hq // hk, 1, hk, 1, 2048, kv_bytes=1)[0].items()
                if key != "Q_RANGE"}
        kc2, vc2 = kc.clone(), vc.clone()
        out = _paged_attention(q, kc2, vc2, bt, seq_lens, qsl, 0.08, 1, 2048, plan=dict(plan, KV_PREFETCH=True),
                               rope=NewTokens(positions, k, v, cache, slots, norm), kv_early=False)
        assert torch.equal(out, outs[False]) and torch.equal(kc2.view(torch.uint8), k_caches[False]), ctx
        kc2, vc2 = kc.clone(), vc.clone()
        out = _paged_attention(q, kc2, vc2, bt, seq_lens, qsl, 0.08, 1, 2048, plan=dict(plan, KV_READBACK=True),
                               rope=NewTokens(positions, k, v, cache, slots, norm))
        assert _rel(out, ref) < TOL[torch.bfloat16] and _rel(out, outs[False]) < 2e-3, ctx
        assert torch.equal(kc2.view(torch.uint8), k_caches[False]), ctx
        assert torch.equal(vc2.view(torch.uint8), vc_ref.view(torch.uint8)), ctx
        # TRACE (benchmarks.program_trace): the rule's launch and its merge, traced, bit for bit the launch
        # without, each program with keys stamped in order on a real SM, the merge's after the attention's
        trace, kc2, vc2 = [], kc.clone(), vc.clone()
        out = _paged_attention(q, kc2, vc2, bt, seq_lens, qsl, 0.08, 1, 2048,
                               rope=NewTokens(positions, k, v, cache, slots, norm), trace=trace)
        assert torch.equal(out, outs[True]) and torch.equal(kc2.view(torch.uint8), k_caches[True]), ctx
        assert [name for name, _ in trace] == ["attention", "merge"], ctx
        attn, merge = (b.cpu() for _, b in trace)
        live = attn[attn[:, 3] > 0]
        assert len(live) >= 1 and (live[:, 0] <= live[:, 1]).all() and (live[:, 1] <= live[:, 3]).all(), ctx
        assert (merge[:, 0] <= merge[:, 1]).all() and (merge[:, 1] <= merge[:, 3]).all(), ctx
        assert int(merge[:, 1].min()) >= int(live[:, 3].max()), ctx  # its wait released once the attention ended
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        assert ((attn[:, 4] >= 0) & (attn[:, 4] < sms)).all(), ctx


def test_paged_attention_graph_capture():
    """Decode under CUDA graph capture: no host sync, replays see new lengths."""
    from tandem.kernels.triton.attention import paged_attention_triton
    q, kc, vc, bt, seq_lens, qsl = _paged_inputs([1] * 4, [4000, 20, 2000, 100], 32, 8, 128, 16,
                                                 torch.bfloat16)
    paged_attention_triton(q, kc, vc, bt, seq_lens, qsl, 0.08, 1, None)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, kc, vc, bt, seq_lens, qsl, 0.08, 1, None)
    for lens in ([4000, 20, 2000, 100], [3999, 1, 17, 4000]):
        seq_lens.copy_(torch.tensor(lens, device=DEVICE))
        q.copy_(torch.randn_like(q))
        graph.replay()
        assert _rel(out, paged_attention_ref(q, kc, vc, bt, seq_lens, qsl, 0.08)) < 2e-2


@pytest.mark.parametrize("heavy_first,offs_32", [(False, False), (True, False), (False, True)])
def test_paged_attention_launch_variants(heavy_first, offs_32):
    """Grid order and 32-bit cache offsets change the schedule and the address math, not the result."""
    from tandem.kernels.triton.attention import _paged_attention
    q_lens, ctx_lens = ATTN_CASES["mixed"]
    args = _paged_inputs(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16)
    ref = paged_attention_ref(*args, 0.09)
    plan = dict(BLOCK_M=128, BLOCK_N=64, NUM_SPLITS=1, num_warps=8, num_stages=2, HEAVY_FIRST=heavy_first,
                OFFS_32=offs_32)
    assert _rel(_paged_attention(*args, 0.09, plan=plan), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("case", ["mixed", "decode", "long_decode"])
def test_paged_attention_quant_out(case):
    """The output written as the FP8 o projection's input (one e4m3 scale a token's head): kernels.fp8.quantize_rows
    of the same launch's bf16 output, on every plan the cases take (prefill, decode, split-K with its merge); the
    codes equal save a rare one a code apart (tests/fp8_gpu.py assert_codes_match: the kernel's division is
    div.full.f32, torch's IEEE; one such code failed an exact comparison once in the thirty-sixth session)."""
    from tandem.kernels.fp8 import fp8_dtype, has_fp8_compute, quantize_rows
    from tandem.kernels.triton.attention import paged_attention_triton
    if not has_fp8_compute(torch.device(DEVICE)):
        pytest.skip("needs a GPU with FP8")
    q_lens, ctx_lens = ATTN_CASES[case]
    args = _paged_inputs(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16)
    bounds = (max(q_lens), max(ctx_lens))
    ref_q, ref_s = quantize_rows(paged_attention_triton(*args, 0.09, *bounds).flatten(1), fp8_dtype(DEVICE), 128)
    _poison(ref_q.numel() * 4 * 8)
    got_q, got_s = paged_attention_triton(*args, 0.09, *bounds, quant=(fp8_dtype(DEVICE), 128))
    assert torch.allclose(got_s, ref_s, rtol=1e-6, atol=0)
    assert_codes_match(got_q, ref_q)


@pytest.mark.parametrize("plan", [
    None,  # the default plans: enough prefill tokens for the 256-row tiles
    dict(BLOCK_M=256, BLOCK_N=64, NUM_SPLITS=1, num_warps=8, num_stages=3, BT_SCALAR=True),
    dict(BLOCK_M=64, BLOCK_N=64, NUM_SPLITS=1, num_warps=4, num_stages=3),  # small grids
    dict(BLOCK_M=128, BLOCK_N=128, NUM_SPLITS=2, num_warps=8, num_stages=2, BT_SCALAR=True),
])
def test_paged_attention_wide_plans(plan):
    """Chunks behind context and a fresh prompt on the prefill plans: the block-table entries read
    as scalars per page (BT_SCALAR), the tile shapes the launch picks by grid size."""
    from tandem.kernels.triton.attention import _launch_plans, _paged_attention
    q_lens, ctx_lens = [1500, 1, 700, 37], [3000, 900, 700, 1037]
    args = _paged_inputs(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16)
    if plan is None:
        wide = _launch_plans(args[0], 4, len(q_lens), 8, max(q_lens), max(ctx_lens))[-1]
        assert wide["BLOCK_M"] == 256 and wide.get("BT_SCALAR"), wide
    ref = paged_attention_ref(*args, 0.09)
    _poison(ref.numel() * 4 * 8)
    out = _paged_attention(*args, 0.09, max(q_lens), max(ctx_lens), plan=plan)
    assert _rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache(dtype):
    from tandem.kernels.triton.attention import store_kvcache_triton
    T, Hk, D, page = 70, 8, 128, 16
    qkv = torch.randn(T, 32 + 2 * Hk, D, device=DEVICE).to(dtype)  # key/value as views of it
    key, value = qkv[:, 32:32 + Hk], qkv[:, 32 + Hk:]
    kc = torch.randn(40, page, Hk, D, device=DEVICE).to(dtype)
    vc = torch.randn(40, page, Hk, D, device=DEVICE).to(dtype)
    slots = torch.randperm(40 * page, device=DEVICE)[:T]
    slots[::7] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kvcache_ref(key, value, kc_ref, vc_ref, slots)
    store_kvcache_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("shape", [(1, 4096), (37, 4096), (5, 3, 1000), (2048, 2048)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(shape, dtype):
    from tandem.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton
    x = torch.randn(shape, device=DEVICE).to(dtype)
    res = torch.randn(shape, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    _poison(x.numel() * 8)
    assert _rel(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < TOL[dtype] / 4
    normed, s = fused_add_rms_norm_triton(x, res, w, 1e-5)
    normed_ref, s_ref = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(s, s_ref) and _rel(normed, normed_ref) < TOL[dtype] / 4
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(rot_fraction, dtype):
    from tandem.kernels.triton.rotary import apply_rotary_triton
    T, Hq, Hk, D = 333, 32, 8, 128
    rot = int(D * rot_fraction)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
    cache = build_cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (T,), device=DEVICE)
    qkv = torch.randn(T, Hq + 2 * Hk, D, device=DEVICE).to(dtype)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hk]
    q_ref, k_ref = apply_rotary_ref(positions, q.clone(), k.clone(), cache)
    v_before = qkv[:, Hq + Hk:].clone()
    q_out, k_out = apply_rotary_triton(positions, q, k, cache)
    assert _rel(q_out, q_ref) < TOL[dtype] / 4 and _rel(k_out, k_ref) < TOL[dtype] / 4
    assert torch.equal(qkv[:, Hq + Hk:], v_before)


@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate_k", [False, True])
def test_rotary_store_kvcache(rot_fraction, qk_norm, dtype, rotate_k):
    from tandem.kernels.triton.rotary import rotary_store_kvcache_triton
    T, Hq, Hk, D, page = 77, 32, 4, 128, 16
    rot = int(D * rot_fraction)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
    cache = build_cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (T,), device=DEVICE)
    qkv = torch.randn(T, Hq + 2 * Hk, D, device=DEVICE).to(dtype)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hk], qkv[:, Hq + Hk:]
    kc = torch.randn(20, page, Hk, D, device=DEVICE).to(dtype)
    vc = torch.randn_like(kc)
    slots = torch.randperm(20 * page, device=DEVICE)[:T]
    slots[::9] = -1
    norm = ((1 + 0.1 * torch.randn(D, device=DEVICE)).to(dtype), (1 + 0.1 * torch.randn(D, device=DEVICE)).to(dtype),
            1e-6) if qk_norm else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k_ref = k.clone()
    q_ref = rotary_store_kvcache_ref(positions, q.clone(), k_ref, v.clone(), cache, kc_ref, vc_ref, slots, norm,
                                     rotate_k)
    k_before = k.clone()
    q_out = rotary_store_kvcache_triton(positions, q, k, v, cache, kc, vc, slots, norm, rotate_k)
    assert q_out.data_ptr() == q.data_ptr()  # in place
    assert _rel(q_out, q_ref) < TOL[dtype] / 4 and _rel(kc, kc_ref) < TOL[dtype] / 4
    assert torch.equal(vc, vc_ref)
    stored = slots >= 0
    assert torch.equal(k[~stored], k_before[~stored])
    if rotate_k:  # k holds exactly what the cache got
        blk, off = slots[stored] // page, slots[stored] % page
        assert torch.equal(k[stored], kc[blk, off]) and _rel(k, k_ref) < TOL[dtype] / 4
    else:
        assert torch.equal(k, k_before)


@pytest.mark.parametrize("experts,top_k", [(128, 8), (8, 2), (60, 4)])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_topk_routing(experts, top_k, num_tokens, scoring, renormalize):
    from tandem.kernels.triton.routing import topk_routing_triton
    logits = torch.randn(num_tokens, experts, device=DEVICE).to(torch.bfloat16)
    w, ids = topk_routing_triton(logits, top_k, renormalize, scoring)
    w_ref, ids_ref = topk_routing_ref(logits, top_k, renormalize, scoring)
    assert torch.allclose(w, w_ref, atol=1e-6, rtol=1e-5) and ids.dtype == torch.int32
    # bf16 logits tie often: any expert of a tied score may be chosen, so check the chosen scores
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    assert torch.equal(scores.gather(1, ids.long()), scores.topk(top_k, dim=-1).values)
    assert (ids.sort(1).values.diff(dim=1) > 0).all()  # no expert twice


@pytest.mark.parametrize("experts,k,top_k", [(128, 2048, 8), (60, 1024, 4)])
@pytest.mark.parametrize("pending_norm", [False, True])
def test_route_token_matches_router_topk_and_quant(experts, k, top_k, pending_norm):
    """route_token_triton (one token's router GEMM, top-k and row quantized to e4m3 in one launch) against the
    bf16 router GEMM, topk_routing_ref and quantize_rows; twice, the second call on the ticket the first put back."""
    from tandem.kernels.fp8 import quantize_rows
    from tandem.kernels.triton.routing import route_token_triton
    torch.manual_seed(experts + pending_norm)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    gate = (torch.randn(experts, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    norm_in, scale = None, 1.0
    if pending_norm:  # x is s * weight of a norm whose 1/rms the kernel applies to the logits
        ss = torch.zeros(16, k // 128, device=DEVICE)
        ss[0] = torch.rand(k // 128, device=DEVICE) * k
        norm_in, scale = (ss, 1e-6), torch.rsqrt(ss[0].sum() / k + 1e-6).item()
    for _ in range(2):
        w, ids, q, qs = route_token_triton(x, gate, top_k, True, "softmax", torch.float8_e4m3fn, norm_in)
        logits = ((x.float() @ gate.float().t()) * scale).to(torch.bfloat16)
        w_ref, ids_ref = topk_routing_ref(logits, top_k, True, "softmax")
        # the kernel's fp32 sums may round to the neighbouring bf16 logit: the chosen experts' reference
        # scores are the top-k up to that rounding, and the weights follow
        scores = logits.float()[0]
        assert ids.dtype == torch.int32 and len(set(ids[0].tolist())) == top_k
        assert scores[ids[0].long()].min() >= scores.topk(top_k).values.min() - 2e-2 * scores.abs().max()
        assert _rel(w.sort(1).values, w_ref.sort(1).values) < 2e-2
        q_ref, qs_ref = quantize_rows(x, torch.float8_e4m3fn, 128)
        assert torch.allclose(qs, qs_ref, rtol=1e-6)
        assert (q.float() != q_ref.float()).float().mean() < 1e-3  # (x / s against x * (1 / s): a rare ulp)
        assert _rel(q.float(), q_ref.float()) < 1e-2


@pytest.mark.parametrize("shape", [(1, 2 * 14336), (77, 2 * 768), (4, 3, 2 * 100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(shape, dtype):
    from tandem.kernels.triton.activation import silu_and_mul_triton
    x = torch.randn(shape, device=DEVICE).to(dtype)
    _poison(x.numel() * 4)
    assert _rel(silu_and_mul_triton(x), silu_and_mul_ref(x)) < TOL[dtype] / 4


MOE_SHAPES = {"mixtral_like": (8, 2, 512, 384), "qwen3_30b_a3b": (128, 8, 2048, 768)}


@pytest.mark.parametrize("model", list(MOE_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts(model, num_tokens, dtype):
    from tandem.kernels.triton.moe import fused_experts_triton
    E, k, H, inter = MOE_SHAPES[model]
    x = torch.randn(num_tokens, H, device=DEVICE).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / math.sqrt(inter)).to(dtype)
    weights, ids = topk_routing(torch.randn(num_tokens, E, device=DEVICE), k, renormalize=True)
    ids[::5, 0] = -1  # experts owned elsewhere
    if num_tokens > 2:
        ids[2, :] = -1
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    _poison(num_tokens * k * H * 8)
    out = fused_experts_triton(x, w13, w2, weights, ids)
    assert _rel(out, ref) < TOL[dtype]
    if num_tokens > 2:
        assert torch.all(out[2] == 0)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_fused_experts_pair_blocks_match_grouping(num_tokens):
    """The decode path (a block per pair, per-token sum) against the grouped path on one input."""
    from tandem.kernels.triton.moe import _fused_experts
    E, k, H, inter = MOE_SHAPES["qwen3_30b_a3b"]
    x = torch.randn(num_tokens, H, device=DEVICE).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / math.sqrt(inter)).to(torch.bfloat16)
    weights, ids = topk_routing(torch.randn(num_tokens, E, device=DEVICE), k, renormalize=True)
    ids[0, 3] = -1
    grouped = dict(BLOCK_M=16, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4, PAIRS=False)
    pairs = dict(grouped, BLOCK_N1=16, PAIRS=True)
    out_pairs = _fused_experts(x, w13, w2, weights, ids, cfg=pairs)
    out_grouped = _fused_experts(x, w13, w2, weights, ids, cfg=grouped)
    assert _rel(out_pairs, out_grouped) < 1e-2
    assert _rel(out_pairs, fused_experts_ref(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]


def test_pdl_chain_in_graph_matches_without():
    """A decode layer's chain of dependent kernels (ours launched with programmatic dependent
    launch, cuBLAS between them) captured in a CUDA graph: replays on new inputs give the bits
    that the same chain gives with PDL off, so no kernel reads its input before the one ahead of
    it has written it."""
    from tandem.kernels.triton.activation import silu_and_mul_triton
    from tandem.kernels.triton.attention import paged_attention_triton
    from tandem.kernels.triton.moe import fused_experts_triton
    from tandem.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton
    from tandem.kernels.triton.routing import topk_routing_triton
    H, E, k, inter = 512, 16, 4, 256
    x = torch.randn(4, H, device=DEVICE, dtype=torch.bfloat16)
    w_norm = torch.rand(H, device=DEVICE, dtype=torch.bfloat16) + 0.5
    w_up = torch.randn(2 * inter, H, device=DEVICE, dtype=torch.bfloat16) / H**0.5
    w_down = torch.randn(H, inter, device=DEVICE, dtype=torch.bfloat16) / inter**0.5
    w_gate = torch.randn(E, H, device=DEVICE, dtype=torch.bfloat16) / H**0.5
    w13 = torch.randn(E, 2 * inter, H, device=DEVICE, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, inter, device=DEVICE, dtype=torch.bfloat16) / inter**0.5
    q, kc, vc, bt, seq_lens, qsl = _paged_inputs([1] * 4, [300, 20, 1000, 64], 4, 2, 128, 16, torch.bfloat16)

    def chain(pdl: bool):
        h = rms_norm_triton(x, w_norm, 1e-6, pdl)
        h = silu_and_mul_triton(h @ w_up.t(), pdl) @ w_down.t()
        h, res = fused_add_rms_norm_triton(h, x, w_norm, 1e-6, pdl)
        weights, ids = topk_routing_triton((h @ w_gate.t()).float(), k, True, pdl=pdl)
        h, _ = fused_add_rms_norm_triton(fused_experts_triton(h, w13, w2, weights, ids, pdl), res, w_norm, 1e-6,
                                         pdl)
        attn = paged_attention_triton(q * h[:, :1, None], kc, vc, bt, seq_lens, qsl, 0.08, 1, None, pdl=pdl)
        return h, attn

    results = []
    for pdl in (False, True):
        chain(pdl)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(pdl)
        torch.manual_seed(7)
        replays = []
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            replays.append([o.clone() for o in outs])
        results.append(replays)
    for without, with_pdl in zip(*results):
        for a, b in zip(without, with_pdl):
            assert not a.isnan().any() and torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 4096), (128, 2048), (1000, 1000), (77, 4500), (151936, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear(rows, n, k, dtype):
    """Decode-sized linear layers (the K split and its ticket reduction included) against a float64
    matmul; a second call on new inputs checks that the tickets were put back."""
    from tandem.kernels.triton.linear import _config, skinny_linear_triton
    w = (torch.randn(n, k, device=DEVICE) / math.sqrt(k)).to(dtype)
    for _ in range(2):
        x = torch.randn(rows, k, device=DEVICE).to(dtype)
        _poison(rows * n * 8)
        out = skinny_linear_triton(x, w)
        assert out.shape == (rows, n) and out.dtype == dtype
        assert _rel(out, x.double() @ w.double().t()) < TOL[dtype]
    split = _config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)["SPLIT_K"]
    for cfg_split, preload in [(s, p) for s in {1, 2, 8} - {split} for p in (False, True)]:
        # the other reduction paths, with and without the weight tile loaded before the wait
        cfg = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=cfg_split, PRELOAD=preload, num_warps=4, num_stages=3)
        assert _rel(skinny_linear_triton(x, w, cfg), x.double() @ w.double().t()) < TOL[dtype]


def test_skinny_linear_graph_and_dispatch():
    """kernels.linear.linear takes the Triton GEMM for <= 16 rows (bias added after) and torch
    above; under graph capture replays see new inputs."""
    from tandem.kernels.linear import linear
    from tandem.kernels.triton.linear import MAX_ROWS
    w = torch.randn(512, 2048, device=DEVICE, dtype=torch.bfloat16) / 45
    b = torch.randn(512, device=DEVICE, dtype=torch.bfloat16)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 2048, device=DEVICE, dtype=torch.bfloat16)
        assert _rel(linear(x, w, b), x.double() @ w.double().t() + b.double()) < TOL[torch.bfloat16]
    x = torch.randn(4, 2048, device=DEVICE, dtype=torch.bfloat16)
    linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert _rel(out, x.double() @ w.double().t()) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="at most 16 rows"):
        from tandem.kernels.triton.linear import skinny_linear_triton
        skinny_linear_triton(torch.zeros(17, 2048, device=DEVICE, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("k1,n,n2", [(4096, 2048, 128), (4096, 4096, 28672), (4096, 2048, 5120), (500, 77, 300)])
def test_skinny_linear_pending_norm(rows, k1, n, n2):
    """o_proj-like GEMM + residual with the RMSNorm left pending (NORM_OUT), then the next GEMM
    applying it (NORM_IN; 128 x 2048 is the MoE router, split 8), against the reference chain
    (GEMM, add, norm, GEMM); both GEMMs' split paths; two calls (tickets put back)."""
    from tandem.kernels.triton.linear import skinny_linear_add_norm_triton, skinny_linear_normed_triton
    dtype, eps = torch.bfloat16, 1e-6
    w1 = (torch.randn(n, k1, device=DEVICE) / math.sqrt(k1)).to(dtype)
    w2 = (torch.randn(n2, n, device=DEVICE) / math.sqrt(n)).to(dtype)
    g = (1 + 0.3 * torch.randn(n, device=DEVICE)).to(dtype)
    for cfg in (None, None, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3)):
        x, res = torch.randn(rows, k1, device=DEVICE).to(dtype), torch.randn(rows, n, device=DEVICE).to(dtype)
        _poison(rows * (n + n2) * 16)
        s, sg, ss = skinny_linear_add_norm_triton(x, w1, res, g, cfg)
        s_ref = (x.double() @ w1.double().t()).to(dtype) + res
        assert _rel(s, s_ref) < TOL[dtype] and _rel(sg, s_ref * g) < TOL[dtype]
        y = skinny_linear_normed_triton(sg, w2, ss, eps, cfg)
        ref = rms_norm_ref(s, g, eps).double() @ w2.double().t()
        assert y.shape == (rows, n2) and _rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("model,num_tokens", [("qwen3_30b_a3b", 1), ("qwen3_30b_a3b", 2), ("mixtral_like", 7),
                                              ("qwen3_30b_a3b", 5)])
def test_routed_experts_pending_norm(model, num_tokens):
    """The first expert GEMM applying a pending RMSNorm (rows s * g, the partial sums of squares
    from the GEMM ahead) against the norm then the experts reference, and the second leaving the
    next one pending (the fused sum, or the sum launch); 5 x top-8 pairs are grouped (the
    routing launch), the others a block per pair."""
    from tandem.kernels.triton import moe
    from tandem.kernels.triton.linear import skinny_linear_add_norm_triton, skinny_linear_normed_triton
    E, k, H, inter = MOE_SHAPES[model]
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / math.sqrt(inter)).to(torch.bfloat16)
    w_o = (torch.randn(H, 512, device=DEVICE) / math.sqrt(512)).to(torch.bfloat16)
    g = (1 + 0.3 * torch.randn(H, device=DEVICE)).to(torch.bfloat16)
    for _ in range(2):
        x = torch.randn(num_tokens, 512, device=DEVICE).to(torch.bfloat16)
        res = torch.randn(num_tokens, H, device=DEVICE).to(torch.bfloat16)
        logits = torch.randn(num_tokens, E, device=DEVICE).to(torch.bfloat16)
        s, sg, ss = skinny_linear_add_norm_triton(x, w_o, res, g)
        out = moe.routed_experts_triton(sg, logits, w13, w2, k, True, "softmax", (ss, 1e-6))
        weights, ids = topk_routing_ref(logits, k, True, "softmax")
        ref = fused_experts_ref(rms_norm_ref(s, g, 1e-6), w13, w2, weights, ids)
        assert _rel(out, ref) < TOL[torch.bfloat16]
        # the output plus the residual with the next norm left pending, applied by the next GEMM
        g2 = (1 + 0.3 * torch.randn(H, device=DEVICE)).to(torch.bfloat16)
        w_q = (torch.randn(640, H, device=DEVICE) / math.sqrt(H)).to(torch.bfloat16)
        s2, sg2, ss2 = moe.routed_experts_triton(sg, logits, w13, w2, k, True, "softmax", (ss, 1e-6), (s, g2))
        assert _rel(s2, out + s) < TOL[torch.bfloat16] and _rel(sg2, s2 * g2) < TOL[torch.bfloat16]
        q = skinny_linear_normed_triton(sg2, w_q, ss2, 1e-6)
        assert _rel(q, rms_norm_ref(s2, g2, 1e-6).double() @ w_q.double().t()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("model,num_tokens", [("qwen3_30b_a3b", 1), ("qwen3_30b_a3b", 2), ("mixtral_like", 1),
                                              ("mixtral_like", 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_fused_sum(model, num_tokens, dtype):
    """The top-k sum done by the second expert GEMM (a block per pair) against the reference and
    against the separate sum kernel; tokens with experts owned elsewhere, and one with none here
    (its row must be zero). Two calls, so a ticket left behind would show."""
    from tandem.kernels.triton import moe
    E, k, H, inter = MOE_SHAPES[model]
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / math.sqrt(inter)).to(dtype)
    for _ in range(2):
        x = torch.randn(num_tokens, H, device=DEVICE).to(dtype)
        weights, ids = topk_routing(torch.randn(num_tokens, E, device=DEVICE), k, renormalize=True)
        ids[0, 0] = -1
        if num_tokens > 2:
            ids[2, :] = -1
        ref = fused_experts_ref(x, w13, w2, weights, ids)
        separate = moe._fused_experts(x, w13, w2, weights, ids,
                                      cfg=dict(moe._config(num_tokens * k, E, dtype), FUSED_SUM=False))
        _poison(num_tokens * k * H * 8)
        fused = moe.fused_experts_triton(x, w13, w2, weights, ids)
        assert _rel(fused, ref) < TOL[dtype]
        assert _rel(fused, separate) < 1e-3
        if num_tokens > 2:
            assert torch.all(fused[2] == 0)


@pytest.mark.parametrize("model,num_tokens", [("qwen3_30b_a3b", 1), ("qwen3_30b_a3b", 2), ("mixtral_like", 7),
                                              ("qwen3_30b_a3b", 5)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_routed_experts(model, num_tokens, scoring, renormalize):
    """Routing inside the first expert GEMM (a block per pair) gives the bits of the routing
    launch + experts, and matches the reference; ties in the logits go to the lower expert.
    5 tokens x top-8 is past a block per pair: the routing launch runs either way."""
    from tandem.kernels.triton import moe
    E, k, H, inter = MOE_SHAPES[model]
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / math.sqrt(inter)).to(torch.bfloat16)
    for _ in range(2):
        x = torch.randn(num_tokens, H, device=DEVICE).to(torch.bfloat16)
        logits = torch.randn(num_tokens, E, device=DEVICE).to(torch.bfloat16)
        logits[0] = -1.0 - torch.rand(E, device=DEVICE)  # experts 2 and 5 tie for the last slot
        logits[0, E - k + 1:] = 2.0 + torch.arange(k - 1, device=DEVICE)
        logits[0, 5] = logits[0, 2] = 1.0
        fused = moe.routed_experts_triton(x, logits, w13, w2, k, renormalize, scoring)
        from tandem.kernels.triton.routing import topk_routing_triton
        weights_t, ids_t = topk_routing_triton(logits, k, renormalize, scoring)
        separate = moe.fused_experts_triton(x, w13, w2, weights_t, ids_t)
        assert torch.equal(fused, separate)
        weights, ids = topk_routing_ref(logits, k, renormalize, scoring)
        assert _rel(fused, fused_experts_ref(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]


ARGMAX_SHAPES = [(1, 128256), (64, 151936), (3, 1000), (5, 4096), (2, 4097), (7, 1), (300, 50)]


@pytest.mark.parametrize("shape", ARGMAX_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax(shape, dtype):
    """One-launch argmax against torch.argmax, with ties across chunks (the first wins), NaN
    (wins), -inf rows and rows of one repeated value; twice, for the tickets."""
    from tandem.kernels.triton.argmax import argmax_triton
    n, v = shape
    for _ in range(2):
        x = torch.randn(n, v, device=DEVICE).to(dtype)
        if v > 1:
            x[0, v - 1] = x[0, v // 3] = x[0].max() + 1  # a tie: the lower index wins
        if n > 1:
            x[1, v // 2] = float("nan")
            x[1, v - 1] = float("nan")
        if n > 2:
            x[2] = float("-inf")
        if n > 3:
            x[3] = 0.5
        assert torch.equal(argmax_triton(x), x.argmax(-1))
        assert torch.equal(argmax_triton(x[:, : max(1, v - 3)]), x[:, : max(1, v - 3)].argmax(-1))  # row stride > cols


def test_argmax_in_graph():
    from tandem.kernels.triton.argmax import argmax_triton
    x = torch.randn(4, 151936, device=DEVICE)
    argmax_triton(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_triton(x * 2)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, x.argmax(-1))

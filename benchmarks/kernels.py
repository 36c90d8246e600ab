"""Time each Triton kernel against torch doing the same work, next to the device's ceilings.

Ceilings are measured in the same run: a device-to-device copy (bytes read + written) and a
bf16 8192^3 matmul. Each row reports the Triton time, the torch time, the bytes the kernel must
move at least and the flops it must do, and the fraction of the ceilings reached.
Shapes: Llama-3-8B (hidden 4096, 32/8 heads, head_dim 128, block 16) and Qwen3-30B-A3B MoE
(hidden 2048, 128 experts, top-8, intermediate 768). Usage: python benchmarks/kernels.py [--out F]
"""
import argparse
import itertools
import json
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tandem.kernels.kv_cache import store_kvcache_ref  # noqa: E402
from tandem.kernels.moe import fused_experts_ref, topk_routing, topk_routing_ref  # noqa: E402
from tandem.kernels.norm import fused_add_rms_norm_ref  # noqa: E402
from tandem.kernels.rotary import apply_rotary_ref, build_cos_sin_cache  # noqa: E402
from tandem.kernels.triton.activation import silu_and_mul_triton  # noqa: E402
from tandem.kernels.triton.attention import (  # noqa: E402
    _paged_attention, paged_attention_triton, store_kvcache_triton)
from tandem.kernels.triton.moe import _fused_experts, fused_experts_triton  # noqa: E402
from tandem.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from tandem.kernels.triton.rotary import apply_rotary_triton, rotary_store_kvcache_triton  # noqa: E402
from tandem.kernels.triton.routing import topk_routing_triton  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
HQ, HK, D, PAGE, HIDDEN = 32, 8, 128, 16, 4096
ROWS: list[dict] = []


def bench(fn, graph: bool = True) -> float:
    """Median milliseconds of GPU time; do_bench flushes L2 before each repetition.

    graph: time replays of a CUDA graph of fn (as the engine runs decode), so that host launch
    overhead stays out; off for torch code that syncs with the host and cannot be captured.
    """
    if not graph:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
    except RuntimeError as e:
        print(f"capture failed ({str(e).splitlines()[0][:80]}); timing eagerly")
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    t = do_bench(g.replay, warmup=25, rep=100, return_mode="median")
    del g
    return t


def ceilings() -> tuple[float, float]:
    src = torch.randn(256 * 2**20, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src), graph=False) / 1e6
    a, b = torch.randn(8192, 8192, device=DEV, dtype=BF16), torch.randn(8192, 8192, device=DEV, dtype=BF16)
    tflops = 2 * 8192**3 / bench(lambda: a @ b, graph=False) / 1e9
    return gbps, tflops


def record(kernel, shape, t_triton, t_torch, nbytes, flops, torch_name, **extra):
    ROWS.append(dict(kernel=kernel, shape=shape, triton_us=t_triton * 1e3, torch_us=t_torch * 1e3,
                     torch_impl=torch_name, bytes=nbytes, flops=flops,
                     gbps=nbytes / t_triton / 1e6, tflops=flops / t_triton / 1e9, **extra))


def paged_setup(batch, ctx, q_len, hk=HK):
    blocks = -(-ctx // PAGE)
    num_blocks = batch * blocks + 16
    kc = torch.randn(num_blocks, PAGE, hk, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, device=DEV)[:batch * blocks].view(batch, blocks).int()
    seq_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, HQ, D, device=DEV, dtype=BF16)
    return q, kc, vc, bt, seq_lens, qsl


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def gather_context(cache, table_row, ctx):
    """The first ctx keys (or values) of a sequence gathered through its block table: [ctx, HK, D]."""
    return cache[table_row].view(-1, HK, D)[:ctx]


def heads_first(rows):
    """[T, H, D] -> [1, H, T, D], SDPA's layout."""
    return rows.transpose(0, 1).unsqueeze(0)


def bench_attention():
    for batch, ctx in [(1, 1024), (1, 8192), (8, 1024), (8, 4096), (8, 8192),
                       (64, 1024), (64, 4096), (64, 8192)]:
        q, kc, vc, bt, sl, qsl = paged_setup(batch, ctx, 1)
        t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, 1, ctx))
        qs = q.view(batch, 1, HQ, D).transpose(1, 2)
        k = torch.randn(batch, HK, ctx, D, device=DEV, dtype=BF16)
        v = torch.randn_like(k)
        t_ref = bench(lambda: sdpa(qs, k, v, False))
        nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
        record("attn_decode", f"B={batch} ctx={ctx}", t, t_ref, nbytes, 4 * batch * HQ * ctx * D, "sdpa(gqa)")
    for ctx in (4096,):
        q, kc, vc, bt, sl, qsl = paged_setup(1, ctx, ctx)
        t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, ctx, ctx))
        qs = q.view(1, ctx, HQ, D).transpose(1, 2)
        k = torch.randn(1, HK, ctx, D, device=DEV, dtype=BF16)
        v = torch.randn_like(k)
        t_ref = bench(lambda: sdpa(qs, k, v, True))
        flops = 4 * HQ * D * ctx * (ctx + 1) / 2
        record("attn_prefill", f"T={ctx} causal", t, t_ref, 4 * q.numel() * 2, flops, "sdpa(gqa,causal)")
        # torch doing the same work: the keys and values gathered through the block table first
        t_same = bench(lambda: sdpa(qs, heads_first(gather_context(kc, bt[0], ctx)),
                                    heads_first(gather_context(vc, bt[0], ctx)), True))
        record("attn_prefill", f"T={ctx} causal (vs gather+sdpa)", t, t_same, 4 * q.numel() * 2, flops,
               "gather+sdpa(gqa,causal)")
        # a fresh prefill as the engine runs it: keys and values read from the new rows, which sit
        # in the qkv projection's output ([T, Hq + 2 Hk, D]), instead of through the block table
        qkv = torch.randn(ctx, HQ + 2 * HK, D, device=DEV, dtype=BF16)
        dense = (qkv[:, HQ:HQ + HK], qkv[:, HQ + HK:])
        t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, ctx, ctx, dense_kv=dense))
        record("attn_prefill", f"T={ctx} causal, new k/v rows", t, t_ref, 4 * q.numel() * 2, flops,
               "sdpa(gqa,causal)")
    # a chunked-prefill continuation: 512 new tokens behind 3584 tokens of context, against torch
    # doing the same work (gather through the block table, SDPA with the offset causal mask)
    ctx, chunk = 4096, 512
    q, kc, vc, bt, sl, qsl = paged_setup(1, ctx, chunk)
    t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, chunk, ctx))
    qs = q.view(1, chunk, HQ, D).transpose(1, 2)
    mask = torch.arange(ctx, device=DEV)[None, :] <= torch.arange(ctx - chunk, ctx, device=DEV)[:, None]
    t_ref = bench(lambda: F.scaled_dot_product_attention(
        qs, heads_first(gather_context(kc, bt[0], ctx)), heads_first(gather_context(vc, bt[0], ctx)),
        attn_mask=mask, enable_gqa=True))
    flops = 4 * HQ * D * chunk * (ctx - chunk + (chunk + 1) / 2)
    record("attn_chunk", f"{chunk} new @ {ctx} ctx", t, t_ref, 2 * ctx * HK * D * 2 * 2, flops,
           "gather+sdpa(gqa,mask)")
    # 4 chunked-prefill chunks of 512 behind 3584 tokens of context, plus 60 decodes at 2k
    q_lens, ctx_lens = [512] * 4 + [1] * 60, [4096] * 4 + [2048] * 60
    blocks = [-(-c // PAGE) for c in ctx_lens]
    kc = torch.randn(sum(blocks) + 16, PAGE, HK, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    bt = torch.zeros(len(blocks), max(blocks), device=DEV, dtype=torch.int32)
    perm, used = torch.randperm(kc.shape[0], device=DEV).int(), 0
    for s, nb in enumerate(blocks):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
    sl = torch.tensor(ctx_lens, device=DEV, dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens, device=DEV).cumsum(0).int()
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=BF16)
    t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, 512, 4096))
    flops = sum(4 * HQ * D * ql * (c - ql + (ql + 1) / 2) for ql, c in zip(q_lens, ctx_lens))
    nbytes = sum(2 * c * HK * D * 2 for c in ctx_lens) + 4 * q.numel()
    record("attn_mixed", "4x512 chunks@4k + 60 dec@2k", t, float("nan"), nbytes, flops, "-")


def bench_store_kvcache():
    for T in (64, 4096):
        key = torch.randn(T, HK, D, device=DEV, dtype=BF16)
        val = torch.randn_like(key)
        kc = torch.randn(8192, PAGE, HK, D, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        slots = torch.randperm(8192 * PAGE, device=DEV)[:T]
        t = bench(lambda: store_kvcache_triton(key, val, kc, vc, slots))
        t_ref = bench(lambda: store_kvcache_ref(key, val, kc, vc, slots), graph=False)
        record("store_kvcache", f"T={T}", t, t_ref, 4 * key.numel() * 2, 0, "index_put (eager)")


def bench_norms():
    w = torch.randn(HIDDEN, device=DEV, dtype=BF16)
    for T in (1, 64, 4096):
        x = torch.randn(T, HIDDEN, device=DEV, dtype=BF16)
        r = torch.randn_like(x)
        t = bench(lambda: rms_norm_triton(x, w, 1e-5))
        t_ref = bench(lambda: F.rms_norm(x, (HIDDEN,), w, 1e-5))
        record("rms_norm", f"T={T} H={HIDDEN}", t, t_ref, 2 * x.numel() * 2, 0, "F.rms_norm")
        t = bench(lambda: fused_add_rms_norm_triton(x, r, w, 1e-5))
        t_ref = bench(lambda: fused_add_rms_norm_ref(x, r, w, 1e-5))
        record("fused_add_rms_norm", f"T={T} H={HIDDEN}", t, t_ref, 4 * x.numel() * 2, 0, "torch ref")


def bench_rotary():
    inv_freq = 1.0 / (500000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cache = build_cos_sin_cache(inv_freq, 8192)
    for T in (64, 4096):
        q = torch.randn(T, HQ, D, device=DEV, dtype=BF16)
        k = torch.randn(T, HK, D, device=DEV, dtype=BF16)
        pos = torch.randint(0, 8192, (T,), device=DEV)
        t = bench(lambda: apply_rotary_triton(pos, q, k, cache))
        t_ref = bench(lambda: apply_rotary_ref(pos, q, k, cache))
        nbytes = 2 * (q.numel() + k.numel()) * 2 + T * D * 4
        record("rotary", f"T={T}", t, t_ref, nbytes, 0, "torch ref")


def bench_rotary_store():
    """The fused q/k norm + rotary + KV store (Qwen3 layout: 32/4 heads) against the separate
    Triton launches it replaces (two rms_norm, rotary, store_kvcache)."""
    hq, hk = 32, 4
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cache = build_cos_sin_cache(inv_freq, 8192)
    qw, kw = torch.randn(D, device=DEV, dtype=BF16), torch.randn(D, device=DEV, dtype=BF16)
    kc = torch.randn(4096, PAGE, hk, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    for T in (1, 64, 4096):
        qkv = torch.randn(T, hq + 2 * hk, D, device=DEV, dtype=BF16)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        pos = torch.randint(0, 8192, (T,), device=DEV)
        slots = torch.randperm(4096 * PAGE, device=DEV)[:T]
        t = bench(lambda: rotary_store_kvcache_triton(pos, q, k, v, cache, kc, vc, slots, (qw, kw, 1e-6)))

        def separate():
            qn, kn = rms_norm_triton(q, qw, 1e-6), rms_norm_triton(k, kw, 1e-6)
            apply_rotary_triton(pos, qn, kn, cache)
            store_kvcache_triton(kn, v, kc, vc, slots)

        t_ref = bench(separate)
        nbytes = 2 * qkv.numel() * 2
        record("qknorm_rotary_store", f"T={T} 32/4 heads", t, t_ref, nbytes, 0, "4 triton launches")


def bench_routing():
    for T in (1, 64, 4096):
        logits = torch.randn(T, 128, device=DEV, dtype=BF16)
        t = bench(lambda: topk_routing_triton(logits, 8, True))
        t_ref = bench(lambda: topk_routing_ref(logits, 8, True))
        record("topk_routing", f"T={T} E=128 k=8", t, t_ref, logits.numel() * 2 + T * 8 * 8, 0, "torch ops")


def bench_silu():
    for T in (64, 4096):
        x = torch.randn(T, 2 * 14336, device=DEV, dtype=BF16)
        t = bench(lambda: silu_and_mul_triton(x))
        t_ref = bench(lambda: F.silu(x[:, :14336]) * x[:, 14336:])
        record("silu_and_mul", f"T={T} I=14336", t, t_ref, x.numel() * 2 * 3 // 2, 0, "F.silu*mul")


def _moe_grouped_mm(x, w13_t, w2_t, weights, ids):
    """torch._grouped_mm over expert-sorted (token, slot) pairs: the same work, torch's kernel."""
    E, k = w13_t.shape[0], ids.shape[1]
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).int()
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13_t, offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w2_t, offs=offs)
    y = y * weights.flatten()[order, None].to(y.dtype)
    return torch.zeros(x.shape[0] * k, x.shape[1], device=x.device, dtype=y.dtype).index_copy_(
        0, order, y).view(-1, k, x.shape[1]).sum(1)


def bench_moe():
    E, k, H, inter = 128, 8, 2048, 768
    w13 = torch.randn(E, 2 * inter, H, device=DEV, dtype=BF16) / math.sqrt(H)
    w2 = torch.randn(E, H, inter, device=DEV, dtype=BF16) / math.sqrt(inter)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    for T in (1, 8, 64, 4096):
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        weights, ids = topk_routing(torch.randn(T, E, device=DEV), k, renormalize=True)
        t = bench(lambda: fused_experts_triton(x, w13, w2, weights, ids))
        t_eager = bench(lambda: fused_experts_triton(x, w13, w2, weights, ids), graph=False)
        name = "torch._grouped_mm (eager)"
        try:
            t_ref = bench(lambda: _moe_grouped_mm(x, w13_t, w2_t, weights, ids), graph=False)
        except (RuntimeError, AttributeError) as e:  # not on this torch/GPU: the per-expert loop
            print(f"grouped_mm unavailable ({str(e).splitlines()[0][:80]}); timing the loop")
            name = "loop of matmuls (eager)"
            t_ref = bench(lambda: fused_experts_ref(x, w13, w2, weights, ids), graph=False)
        active = torch.unique(ids).numel()
        nbytes = active * 3 * H * inter * 2 + 2 * x.numel() * 2
        record("moe_experts", f"T={T} active={active}", t, t_ref, nbytes, 2 * T * k * 3 * H * inter, name,
               triton_eager_us=t_eager * 1e3)
        print(f"moe T={T}: triton eager {t_eager * 1e3:.1f} us (graph {t * 1e3:.1f} us)")


def sweep_attention():
    """Variants of the prefill attention kernel (tiles, warps, stages, grid order, 32-bit
    offsets), for keys read through the block table (paged) and from the new rows (dense)."""
    ctx = 4096
    q, kc, vc, bt, sl, qsl = paged_setup(1, ctx, ctx)
    qs = q.view(1, ctx, HQ, D).transpose(1, 2)
    k = torch.randn(1, HK, ctx, D, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    t_sdpa = bench(lambda: sdpa(qs, k, v, True))
    print(f"sweep prefill 4k: sdpa {t_sdpa * 1e3:.1f} us")
    qkv = torch.randn(ctx, HQ + 2 * HK, D, device=DEV, dtype=BF16)
    dense = (qkv[:, HQ:HQ + HK], qkv[:, HQ + HK:])
    # (5 stages: the first count at which Triton double-buffers K/V behind the block-table stage)
    plans = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 5),
             (256, 64, 8, 5)]
    for kind, dense_kv, scalar in (("paged", None, False), ("paged", None, True), ("dense", dense, False)):
        for bm, bn, w, st in plans:
            plan = dict(BLOCK_M=bm, BLOCK_N=bn, NUM_SPLITS=1, num_warps=w, num_stages=st, HEAVY_FIRST=True,
                        OFFS_32=True, DENSE=dense_kv is not None, BT_SCALAR=scalar)
            try:
                t = bench(lambda: _paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, ctx, ctx, plan=plan,
                                                   dense_kv=dense_kv))
                tf = 4 * HQ * D * ctx * (ctx + 1) / 2 / t / 1e9
                print(f"sweep prefill 4k {kind} {plan}: {t * 1e3:.1f} us {tf:.0f} TFLOP/s {t_sdpa / t:.2f}x sdpa")
            except Exception as e:  # out of shared memory etc.
                print(f"sweep prefill 4k {kind} {plan}: failed {str(e).splitlines()[0][:60]}")
    # the context gathered through the block table into rows, then the dense launch
    plan = dict(BLOCK_M=128, BLOCK_N=64, NUM_SPLITS=1, num_warps=8, num_stages=3, DENSE=True)

    def gathered():
        rows = (gather_context(kc, bt[0], ctx), gather_context(vc, bt[0], ctx))
        return _paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, ctx, ctx, plan=plan, dense_kv=rows)
    t = bench(gathered)
    t_gather = bench(lambda: (kc[bt[0]], vc[bt[0]]))
    print(f"sweep prefill 4k gather + dense: {t * 1e3:.1f} us ({t_gather * 1e3:.1f} us of gather) "
          f"{t_sdpa / t:.2f}x sdpa")
    print(f"sweep prefill 4k: sdpa again {bench(lambda: sdpa(qs, k, v, True)) * 1e3:.1f} us")


def sweep_chunk_attention():
    """Plans for a chunked-prefill continuation whose 256-row grid leaves SMs idle (512 new
    tokens behind 3584: 8 q tiles x 8 kv heads), including splitting its keys."""
    for ctx, chunk in ((4096, 512), (4096, 1024), (8192, 512)):
        q, kc, vc, bt, sl, qsl = paged_setup(1, ctx, chunk)
        t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, chunk, ctx))
        print(f"sweep chunk {chunk}@{ctx} default: {t * 1e3:.1f} us")
        for bm, bn, w, st, scalar, splits in [(256, 64, 8, 3, True, 2), (256, 64, 8, 3, True, 4),
                                              (128, 64, 4, 3, False, 1), (128, 128, 8, 3, True, 1),
                                              (128, 64, 8, 3, True, 1), (128, 128, 8, 3, True, 2),
                                              (64, 64, 4, 3, False, 1)]:
            plan = dict(BLOCK_M=bm, BLOCK_N=bn, NUM_SPLITS=splits, num_warps=w, num_stages=st, BT_SCALAR=scalar)
            try:
                t = bench(lambda: _paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, chunk, ctx, plan=plan))
                print(f"sweep chunk {chunk}@{ctx} {plan}: {t * 1e3:.1f} us")
            except Exception as e:  # out of shared memory etc.
                print(f"sweep chunk {chunk}@{ctx} {plan}: failed {str(e).splitlines()[0][:60]}")


DECODE_SWEEP_SHAPES = [(1, 1024, HK), (64, 1024, HK), (64, 4096, HK)]  # (sequences, context, KV heads)
# grids between a batch of one or two and a full GPU, with Llama-3-8B's 8 KV heads and Qwen3-30B-A3B's 4
DECODE_MID_SHAPES = [(8, 1024, 4), (16, 1024, 4), (32, 1024, 4), (64, 1024, 4), (32, 4096, 4), (16, 1024, 8),
                     (32, 1024, 8), (16, 4096, 8)]


def sweep_decode_attention(kv_dtype: torch.dtype = BF16, regs_only: bool = False, mid: bool = False):
    """Decode launch plans as a CUDA graph runs them: max_seq_len = max_model_len (8192), so the
    split count is fixed for the longest context and the keys per split adapt at run time. With an
    fp8 cache (kv_dtype) as the engine's --kv-cache-dtype fp8 stores it; GB/s counts K and V bytes.
    Each plan's output is checked against paged_attention_ref first (relative error < 1e-2).
    mid: the DECODE_MID_SHAPES grids instead, over splits 1-16, 64/128-key tiles, 4/8 warps, 2/3
    stages, and KV_AHEAD (at 1 stage) for the split plans."""
    from tandem.kernels.attention import paged_attention_ref
    from tandem.kernels.triton.attention import _launch_plans
    for batch, ctx, hk in DECODE_MID_SHAPES if mid else DECODE_SWEEP_SHAPES:
        q, kc, vc, bt, sl, qsl = paged_setup(batch, ctx, 1, hk)
        kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
        kv = 2 * batch * ctx * hk * D * kc.element_size()
        ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, D**-0.5).float()
        default = _launch_plans(q, HQ // hk, batch, hk, 1, 8192, kv_bytes=kc.element_size())[0]
        t = bench(lambda: paged_attention_triton(q, kc, vc, bt, sl, qsl, D**-0.5, 1, 8192))
        print(f"sweep decode B={batch} ctx={ctx} Hk={hk} {kv_dtype} default {default}: {t * 1e3:.1f} us "
              f"{kv / t / 1e6:.0f} GB/s", flush=True)
        if mid:
            space = [(bn, splits, w, 1 if ahead else st, ahead) for bn, splits, w, st, ahead
                     in itertools.product((64, 128), (1, 2, 4, 8, 16), (4, 8), (2, 3), (False, True))
                     if not ahead or (splits > 1 and st == 2)]
        elif default["NUM_SPLITS"] == 1:  # the grid fills the GPU: few or no splits
            # 5 stages: K/V double-buffered (Triton gives the block table the first stage from 3 on)
            space = itertools.product((64, 128), (1, 2), (4, 8), (2, 3, 4, 5), (False, True))
        else:
            space = itertools.product((32, 64, 128), (16, 32, 64), (2, 4), (2,), (False, True))
        if regs_only:  # the register cap (ptxas maxrregcount: more programs per SM) on a few tile shapes
            tiles = ((128, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 4, 5))
            space = [(bn, default["NUM_SPLITS"], w, st, regs) for bn, w, st in tiles
                     for regs in (0, 168, 128, 96)]
        for bn, splits, w, st, knob in space:  # knob: the register cap (regs_only), KV_AHEAD (mid), else BT_SCALAR
            knobs = dict(maxnreg=knob) if regs_only else dict(KV_AHEAD=knob) if mid else dict(BT_SCALAR=knob)
            plan = dict(default, BLOCK_N=bn, NUM_SPLITS=splits, num_warps=w, num_stages=st, **knobs)
            plan.pop("Q_RANGE")
            run = lambda: _paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, 1, 8192, plan=plan)  # noqa: E731
            try:
                err = ((run().float() - ref).norm() / ref.norm()).item()
                t = bench(run)
            except Exception as e:  # out of shared memory etc.
                print(f"sweep decode B={batch} ctx={ctx} Hk={hk} {plan}: failed {str(e).splitlines()[0][:60]}")
                continue
            if not err < 1e-2:
                print(f"sweep decode B={batch} ctx={ctx} Hk={hk} {plan}: WRONG, relative error {err:.3g}", flush=True)
                continue
            print(f"sweep decode B={batch} ctx={ctx} Hk={hk} {plan}: {t * 1e3:.1f} us {kv / t / 1e6:.0f} GB/s", flush=True)


def sweep_moe():
    """Variants of the MoE decode path (grouped vs. a block per pair; each GEMM's tiles apart)
    and where MoE time goes."""
    E, k, H, inter = 128, 8, 2048, 768
    w13 = torch.randn(E, 2 * inter, H, device=DEV, dtype=BF16) / math.sqrt(H)
    w2 = torch.randn(E, H, inter, device=DEV, dtype=BF16) / math.sqrt(inter)
    for T in (1, 2):
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        weights, ids = topk_routing(torch.randn(T, E, device=DEV), k, renormalize=True)
        grouped = dict(BLOCK_M=16, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4, PAIRS=False)
        t = bench(lambda: _fused_experts(x, w13, w2, weights, ids, cfg=grouped))
        print(f"sweep moe T={T} grouped (previous path): {t * 1e3:.1f} us")
        base = dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4, PAIRS=True)
        best = {}
        for i, grid in ((1, itertools.product((16, 32), (64, 128, 256), (3, 4, 6), (2, 4))),
                        (2, itertools.product((32, 64, 128), (64, 128, 256), (2, 3, 4), (2, 4)))):
            for bn, bk, st, w in grid:  # one GEMM's tiles varied, the other's kept at base
                cfg = dict(base, **{f"BLOCK_N{i}": bn, f"BLOCK_K{i}": bk, f"num_stages{i}": st, f"num_warps{i}": w})
                try:
                    t = bench(lambda: _fused_experts(x, w13, w2, weights, ids, cfg=cfg))
                except Exception as e:  # out of shared memory etc.
                    print(f"sweep moe T={T} gemm{i} {cfg}: failed {str(e).splitlines()[0][:60]}")
                    continue
                print(f"sweep moe T={T} gemm{i} {cfg}: {t * 1e3:.1f} us")
                if i not in best or t < best[i][1]:
                    best[i] = (cfg, t)
        both = dict(base, **{k: v for i in best for k, v in best[i][0].items() if k.endswith(str(i))})
        t = bench(lambda: _fused_experts(x, w13, w2, weights, ids, cfg=both))
        print(f"sweep moe T={T} best-both {both}: {t * 1e3:.1f} us (base "
              f"{bench(lambda: _fused_experts(x, w13, w2, weights, ids, cfg=base)) * 1e3:.1f} us)")
    for T in (1, 4096):
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        weights, ids = topk_routing(torch.randn(T, E, device=DEV), k, renormalize=True)
        fused_experts_triton(x, w13, w2, weights, ids)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fused_experts_triton(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
        print(f"profile moe T={T} (20 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))


SECTIONS = dict(attention=bench_attention, store=bench_store_kvcache, norm=bench_norms, rotary=bench_rotary,
                rotary_store=bench_rotary_store, routing=bench_routing, silu=bench_silu, moe=bench_moe)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/kernels.json")
    parser.add_argument("--only", default="",
                        help="comma-separated: attention,store,norm,rotary,rotary_store,routing,silu,moe "
                             "(and decode, chunk: a --sweep of decode / chunked-prefill attention plans only)")
    parser.add_argument("--sweep", action="store_true", help="time tile-shape variants first")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="the cache dtype of the decode sweep (fp8: e4m3, as --kv-cache-dtype fp8)")
    parser.add_argument("--max-regs", action="store_true",
                        help="the decode sweep times register caps (more programs per SM) on a few tile shapes instead")
    parser.add_argument("--mid", action="store_true",
                        help="the decode sweep's grids are 8-64 sequences with 4 or 8 KV heads (DECODE_MID_SHAPES)")
    args = parser.parse_args()
    torch.manual_seed(0)
    only = args.only.split(",") if args.only else list(SECTIONS)
    if args.sweep:
        kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else BF16
        sweeps = dict(attention=sweep_attention, chunk=sweep_chunk_attention,
                      decode=lambda: sweep_decode_attention(kv_dtype, args.max_regs, args.mid), moe=sweep_moe)
        for name, fn in sweeps.items():
            if name in only:
                fn()
    gbps, tflops = ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy {gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    for name, fn in SECTIONS.items():
        if name in only:
            try:
                fn()
            except Exception:  # report and go on: one broken section must not hide the others
                traceback.print_exc()
    print(f"{'kernel':<19}{'shape':<30}{'triton us':>10}{'torch us':>10}{'speedup':>8}"
          f"{'GB/s':>7}{'%bw':>5}{'TF/s':>7}{'%mm':>5}")
    for r in ROWS:
        r["pct_bw"], r["pct_mm"] = 100 * r["gbps"] / gbps, 100 * r["tflops"] / tflops
        print(f"{r['kernel']:<19}{r['shape']:<30}{r['triton_us']:>10.1f}{r['torch_us']:>10.1f}"
              f"{r['torch_us'] / r['triton_us']:>8.2f}{r['gbps']:>7.0f}{r['pct_bw']:>5.0f}"
              f"{r['tflops']:>7.1f}{r['pct_mm']:>5.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_gbps=gbps,
                                   matmul_tflops=tflops, rows=ROWS), indent=1))


if __name__ == "__main__":
    main()

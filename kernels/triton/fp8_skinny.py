"""The FP8 GEMM for decode-sized batches (<= MAX_ROWS rows): kernels/triton/linear.py's skinny
GEMM on fp8 weights, with kernels/fp8.py's scales and activation quantization.

At a few rows a linear layer is a read of its weight, so the grid is laid out to stream it: each
program takes a strip of BLOCK_N output columns and, where the strips alone leave SMs idle, a
share of K (SPLIT_K). Split programs write float32 partials; the strip's last program to take a
ticket (kernels/triton/device.py) sums them, writes the output and puts the ticket back to 0.
The first weight tile is loaded before the PDL wait (kernels/triton/pdl.py): it depends on no
kernel ahead.

QUANT (a tile plan's choice): the program quantizes its rows of x (bf16/fp16) itself, as
kernels.fp8.quantize_rows does, instead of a quantization launch ahead of it:
  block-scaled (BLOCK_K = the weight's K block): each K tile is one activation group, so its
    scale is the tile's row amax / fp8 max; the dot of the tile is scaled on the float32
    accumulator by that and the weight block's scale.
  per-channel: a first pass over the row's K finds each row's amax (the program reads its rows'
    whole K, which is why plans turn it on only for very few rows); the sum is scaled at the end.
Without QUANT, x is fp8 with its scales from quantize_rows_triton below.

SWAP (a plan's choice): the tile computes out.T = w @ x.T, the weight strip as the MMA's M side, so
that 1-32 rows run on Hopper's fp8 wgmma (m64 n16/n32) instead of mma.sync, which has no fp8 form on
sm_90 (Triton converts both operands to f16 for it). The Llama-3-8B step at b=1 took 2.93 ms with
SWAP plans against 3.06 / 3.05 ms before and after (H200, 2026-11-27).

Tile plans come from PLANS, keyed by (row bucket, N, K, K block) with a rule-made default
(plan()); `plans()` lists every distinct one a model's shapes can take. No autotuning at serve
time: a plan is a function of the shape, so compile-ahead builds every one it will use.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, num_sms, tickets
from tandem.kernels.triton.linear import MAX_ROWS as NORM_ROWS
from tandem.kernels.triton.linear import _write_out, block_scales, pending_rstd, w8_scale_kind, w_scale_ptrs
from tandem.kernels.triton.pdl import launch_args, wait_previous

MAX_ROWS = 64
ROW_BUCKETS = (16, 32, 64)  # BLOCK_M of the decode tile by rows


@triton.jit
def _quant_tile(x, fp8_max, q_ty: tl.constexpr):
    """x [BM, BK] float32 -> (x / s clamped, in q_ty; s [BM] = max(amax(|x|) / fp8_max, 1e-12))."""
    s = tl.maximum(tl.max(tl.abs(x), axis=1) / fp8_max, 1e-12)
    return tl.minimum(tl.maximum(x / s[:, None], -fp8_max), fp8_max).to(q_ty), s


@triton.jit
def _k_mask(rk, k_left, EVEN: tl.constexpr):
    return (rk < k_left) | EVEN


@triton.jit
def _w_tile(w_ptrs, n_mask, k_ok, SWAP: tl.constexpr):
    """The weight tile at w_ptrs: [BK, BN], or [BN, BK] with SWAP (w's own K-contiguous rows)."""
    if SWAP:
        mask = n_mask[:, None] & k_ok[None, :]
    else:
        mask = n_mask[None, :] & k_ok[:, None]
    return tl.load(w_ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_scales(xs_ptrs, ws_ptrs, kb, nkb, m_mask, n_mask, PER_CHANNEL: tl.constexpr, QUANT: tl.constexpr,
                 W_SCALAR: tl.constexpr):
    """Block-scaled: K block kb's scales (kb clamped to the nkb blocks of K), the rows' [BM] (ones
    with QUANT, which makes its own) and the columns' [BN], or with W_SCALAR the strip's one (ws_ptrs
    a scalar: the strip lies inside one weight block of rows); per-channel: unused ones. The K loop
    loads them a tile ahead of their _tile_dot: Triton's pipeliner leaves a scale load inside the
    loop synchronous, and each tile then waited for it (an L2 or HBM round trip) before the next
    tile's loads were issued."""
    if PER_CHANNEL:
        return m_mask.to(tl.float32), n_mask.to(tl.float32)
    kb = tl.minimum(kb, nkb - 1)
    s = m_mask.to(tl.float32)
    if not QUANT:
        s = tl.load(xs_ptrs + kb, mask=m_mask, other=0.0)
    return s, block_scales(ws_ptrs, kb, n_mask, W_SCALAR)


@triton.jit
def _tile_dot(acc, xt, w, a_s, s, w_s, fp8_max, q_ty: tl.constexpr,
              PER_CHANNEL: tl.constexpr, QUANT: tl.constexpr, SWAP: tl.constexpr, W_SCALAR: tl.constexpr):
    """acc plus one K tile: x tile xt [BM, BK] (bf16/fp16 with QUANT, else fp8), w tile [BK, BN]
    fp8; per-channel: a_s [BM] the rows' scales (applied by the caller at the end); block: the
    tile's K block scales s [BM] (the rows', unless QUANT makes them) and w_s [BN], or the strip's
    one with W_SCALAR (_tile_scales), on the product. SWAP: w [BN, BK] and acc [BN, BM]
    (acc.T += w @ xt.T)."""
    if PER_CHANNEL:
        if QUANT:
            xt = tl.minimum(tl.maximum(xt.to(tl.float32) / a_s[:, None], -fp8_max), fp8_max).to(q_ty)
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, w, acc)
    else:
        if QUANT:
            xt, s = _quant_tile(xt.to(tl.float32), fp8_max, q_ty)
        if W_SCALAR:  # one multiply-add an element, by the rows' scales times the strip's
            if SWAP:
                acc += tl.dot(w, tl.trans(xt)) * (s * w_s)[None, :]
            else:
                acc += tl.dot(xt, w) * (s * w_s)[:, None]
        elif SWAP:
            acc += tl.dot(w, tl.trans(xt)) * w_s[:, None] * s[None, :]
        else:
            acc += tl.dot(xt, w) * s[:, None] * w_s[None, :]
    return acc


@triton.jit
def _early_tile(w0, w_ptrs, i: tl.constexpr, PRELOAD: tl.constexpr, n_mask, rk, k_left, BLOCK_K: tl.constexpr,
                SWAP: tl.constexpr):
    """Weight tile i of a program's K range when i < PRELOAD (loaded before the PDL wait), else w0 (unused)."""
    w = w0
    if i < PRELOAD:
        w = _w_tile(w_ptrs + i * BLOCK_K, n_mask, _k_mask(rk, k_left - i * BLOCK_K, False), SWAP)
    return w


@triton.jit
def _peeled_tile(acc, w, i: tl.constexpr, x_ptrs, xs_ptrs, ws_ptrs, kb, nkb, k_left, x_s, w_s, a_s, m_mask, n_mask, rk,
                 fp8_max, q_ty: tl.constexpr, BLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr, QUANT: tl.constexpr,
                 SWAP: tl.constexpr, W_SCALAR: tl.constexpr):
    """acc plus tile i of the program's K range, its weight tile w loaded before the wait and its scales
    (x_s, w_s) a tile ahead; returns acc and tile i + 1's scales."""
    xt = tl.load(x_ptrs + i * BLOCK_K, mask=m_mask[:, None] & _k_mask(rk, k_left - i * BLOCK_K, False)[None, :],
                 other=0.0)
    x_s_next, w_s_next = _tile_scales(xs_ptrs, ws_ptrs, kb + i + 1, nkb, m_mask, n_mask, PER_CHANNEL, QUANT, W_SCALAR)
    acc = _tile_dot(acc, xt, w, a_s, x_s, w_s, fp8_max, q_ty, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
    return acc, x_s_next, w_s_next


@triton.jit
def _fp8_skinny_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm, stride_xsm, stride_wn,
    stride_wsn, stride_om, rows_per_scale, fp8_max, res_ptr, g_ptr, sg_ptr, ss_ptr, ss_in_ptr, in_strips, eps,
    stride_rm, stride_gm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PER_CHANNEL: tl.constexpr, QUANT: tl.constexpr, NORM_OUT: tl.constexpr,
    NORM_IN: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr = 1,
    SWAP: tl.constexpr = False, W_SCALAR: tl.constexpr = False,
):
    """out [M, N] = quant(x) @ w.T with the scales (module docstring). x [M, K] (bf16/fp16 with
    QUANT, else fp8 with xs [M, G]); w [N, K] fp8 with ws [N / rows_per_scale, Kb] (block) or [N];
    part [SPLIT_K, BLOCK_M, N] float32 when SPLIT_K > 1. Block-scaled: BLOCK_K = the K block.
    NORM_OUT / NORM_IN: the pending RMSNorm of kernels/triton/linear.py (its _write_out and
    pending_rstd; NORM_OUT with BLOCK_M = its MAX_ROWS): NORM_OUT adds the residual res [M, N] and
    writes sg = s * g and ss [BLOCK_M, strips]; NORM_IN scales the rows by their 1/rms from
    ss_in [BLOCK_M, in_strips] (x is then sg: quantizing it commutes with that row scale).
    PRELOAD (1-4): weight tiles loaded before the PDL wait, while the kernel ahead runs.
    SWAP: each tile computes out.T = w @ x.T, the weight tile as the MMA's M side (BLOCK_N >= 64):
    at 16-32 rows that is Hopper's fp8 wgmma (m64 n16-32), where x's rows as M take mma.sync,
    which has no fp8 form on sm_90 and converts both operands to f16 on the conversion units.
    W_SCALAR (block-scaled, BLOCK_N dividing the weight's row block): the strip's columns share one
    weight scale a K block, loaded once as a scalar instead of once per column a thread holds."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    q_ty = w_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    x_row = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    x_ptrs = x_row + (k_lo + rk)[None, :]
    if SWAP:
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    else:
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
    ws_ptrs = w_scale_ptrs(ws_ptr, rn, pid_n * BLOCK_N, rows_per_scale, stride_wsn, 3 if W_SCALAR else 2)
    xs_ptrs = xs_ptr + rm.to(tl.int64) * stride_xsm
    # the first PRELOAD weight tiles do not depend on the kernel ahead (PDL)
    w0 = _w_tile(w_ptrs, n_mask, _k_mask(rk, k_hi - k_lo, False), SWAP)
    w1 = _early_tile(w0, w_ptrs, 1, PRELOAD, n_mask, rk, k_hi - k_lo, BLOCK_K, SWAP)
    w2 = _early_tile(w0, w_ptrs, 2, PRELOAD, n_mask, rk, k_hi - k_lo, BLOCK_K, SWAP)
    w3 = _early_tile(w0, w_ptrs, 3, PRELOAD, n_mask, rk, k_hi - k_lo, BLOCK_K, SWAP)
    wait_previous(PDL)
    out_mask = m_mask[:, None] & n_mask[None, :]
    r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g = tl.zeros([BLOCK_N], dtype=tl.float32)
    if NORM_OUT:  # issued now, used by the epilogue
        r = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    a_s = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PER_CHANNEL:
        if QUANT:  # each row's amax over all of K
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xt = tl.load(x_row + (k0 + rk)[None, :], mask=m_mask[:, None] & _k_mask(rk, K - k0, EVEN_K)[None, :],
                             other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(xt.to(tl.float32)), axis=1))
            a_s = tl.maximum(amax / fp8_max, 1e-12)
        else:
            a_s = tl.load(xs_ptrs, mask=m_mask, other=0.0)
    # the PRELOAD tiles peeled off the loop (their weights came before the wait); an empty range (a
    # split past K) reads nothing and adds 0, its scale index clamped
    nkb = tl.cdiv(K, BLOCK_K)
    kb = k_lo // BLOCK_K
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_s, w_s = _tile_scales(xs_ptrs, ws_ptrs, kb, nkb, m_mask, n_mask, PER_CHANNEL, QUANT, W_SCALAR)
    acc, x_s, w_s = _peeled_tile(acc, w0, 0, x_ptrs, xs_ptrs, ws_ptrs, kb, nkb, k_hi - k_lo, x_s, w_s, a_s, m_mask,
                                 n_mask, rk, fp8_max, q_ty, BLOCK_K, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
    if PRELOAD >= 2:
        acc, x_s, w_s = _peeled_tile(acc, w1, 1, x_ptrs, xs_ptrs, ws_ptrs, kb, nkb, k_hi - k_lo, x_s, w_s, a_s, m_mask,
                                     n_mask, rk, fp8_max, q_ty, BLOCK_K, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
    if PRELOAD >= 3:
        acc, x_s, w_s = _peeled_tile(acc, w2, 2, x_ptrs, xs_ptrs, ws_ptrs, kb, nkb, k_hi - k_lo, x_s, w_s, a_s, m_mask,
                                     n_mask, rk, fp8_max, q_ty, BLOCK_K, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
    if PRELOAD >= 4:
        acc, x_s, w_s = _peeled_tile(acc, w3, 3, x_ptrs, xs_ptrs, ws_ptrs, kb, nkb, k_hi - k_lo, x_s, w_s, a_s, m_mask,
                                     n_mask, rk, fp8_max, q_ty, BLOCK_K, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
    x_ptrs += (PRELOAD - 1) * BLOCK_K
    w_ptrs += (PRELOAD - 1) * BLOCK_K
    for k0 in range(k_lo + PRELOAD * BLOCK_K, k_hi, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_left = _k_mask(rk, k_hi - k0, EVEN_K)
        w = _w_tile(w_ptrs, n_mask, k_left, SWAP)
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_left[None, :], other=0.0)
        x_s_next, w_s_next = _tile_scales(xs_ptrs, ws_ptrs, k0 // BLOCK_K + 1, nkb, m_mask, n_mask, PER_CHANNEL,
                                          QUANT, W_SCALAR)  # a tile ahead (_tile_scales)
        acc = _tile_dot(acc, xt, w, a_s, x_s, w_s, fp8_max, q_ty, PER_CHANNEL, QUANT, SWAP, W_SCALAR)
        x_s, w_s = x_s_next, w_s_next
    if SWAP:
        acc = tl.trans(acc)
    if PER_CHANNEL:
        acc *= a_s[:, None] * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    if NORM_IN:
        acc *= pending_rstd(ss_in_ptr, rm, m_mask, in_strips, K, eps, S_PAD)[:, None]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    sg_ptrs = sg_ptr + rm[:, None] * stride_gm + rn[None, :]
    strips = tl.num_programs(0)
    if SPLIT_K == 1:
        _write_out(out_ptrs, acc, out_mask, rm, n_mask, pid_n, r, g, sg_ptrs, ss_ptr, strips, NORM_OUT)
    else:
        tl.store(part_ptr + (pid_k * BLOCK_M + rm[:, None]) * N + rn[None, :], acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (s * BLOCK_M + rm[:, None]) * N + rn[None, :], mask=out_mask,
                                 other=0.0, cache_modifier=".cg")
            _write_out(out_ptrs, total, out_mask, rm, n_mask, pid_n, r, g, sg_ptrs, ss_ptr, strips, NORM_OUT)
            tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def w_scalar(block: tuple[int, int] | None, block_n: int) -> bool:
    """The kernel's W_SCALAR: block-scaled, every strip inside one row block of the scale grid."""
    return block is not None and w8_scale_kind(2, block, (block_n, 0)) == 3


def row_bucket(m: int) -> int:
    """BLOCK_M of the decode tile for m <= MAX_ROWS rows."""
    return next(b for b in ROW_BUCKETS if m <= b)


def _plan(bn: int, bk: int, split: int, quant: bool, warps: int, swap: bool = False) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, QUANT=quant, num_warps=warps, num_stages=4,
                **({"SWAP": True} if swap else {}))


# Measured plans: (row bucket, N, K, the weight's K block or None per-channel) -> plan, the best of
# `python -m benchmarks.fp8_gemm --rows 1 64 --layouts block channel` (each candidate back to back in
# a CUDA graph over weights that do not fit in L2, as a decode step reads them; H100, 2026-11-25;
# Llama-3-8B and Qwen3-30B-A3B projections), where it beat the rule (then: default_plan) by >= 3%.
# _plan(BLOCK_N, BLOCK_K, SPLIT_K, QUANT, num_warps); the comments: us per call at 1 or 64 rows,
# that plan / the rule then (which quantized in the GEMM at 16 rows).
PLANS: dict[tuple[int, int, int, int | None], dict] = {
    # H200, 2026-11-29, in the Llama-3-8B b=1 step (benchmarks.ab_decode, plans as variants): every tile of a
    # program before the PDL wait with one stage, the input quantized in the GEMM (no launch ahead): 2.788 / 2.804 ms
    (16, 6144, 4096, 128): dict(_plan(128, 128, 8, True, 4, swap=True), num_stages=1, PRELOAD=4),
    (16, 6144, 4096, None): _plan(64, 256, 1, False, 4, swap=True),  # H100 11-27, 16 rows: 13.7 / 14.9
    (16, 4096, 4096, 128): _plan(128, 128, 8, True, 4, swap=True),  # H100 11-27: 10.2 / 11.3
    (16, 4096, 4096, None): _plan(64, 512, 1, False, 4, swap=True),  # H100 11-27, 16 rows: 11.1 / 13.2
    (16, 28672, 4096, 128): _plan(64, 128, 1, False, 4, swap=True),  # H100 11-27: 47.7 / 48.3
    (16, 28672, 4096, None): _plan(64, 256, 1, False, 4, swap=True),  # H100 11-27, 16 rows: 48.3 / 52.5
    # H200, 2026-11-29, in the Llama-3-8B b=1 step (benchmarks.plan_tune, then ab_decode): 8 warps, 2.743 / 2.758 ms
    # (before, the H100 11-27 sweep's 4 warps: 27.3 us alone against the rule's 28.1)
    (16, 4096, 14336, 128): _plan(128, 128, 8, True, 8, swap=True),
    (16, 4096, 14336, None): _plan(64, 512, 1, False, 4, swap=True),  # H100 11-27, 16 rows: 33.7 / 37.8
    (16, 5120, 2048, 128): _plan(64, 128, 8, True, 2),  # 7.5/11.4
    (16, 5120, 2048, None): _plan(64, 256, 1, False, 4, swap=True),  # H100 11-27, 16 rows: 8.4 / 9.8
    # H200, 2026-11-29, in the Qwen3-30B-A3B b=1 step: both tiles of a program before the wait, one stage, SWAP:
    # 2.402 ms against 2.414 for 4 tiles a program (256 programs), which had taken 2.408 against 2.457 (this plan's
    # predecessor, _plan(64, 128, 16, True, 2))
    (16, 2048, 4096, 128): dict(_plan(64, 128, 16, True, 4, swap=True), num_stages=1, PRELOAD=2),
    (16, 2048, 4096, None): _plan(64, 512, 4, False, 4, swap=True),  # H100 11-27, 16 rows: 8.8 / 9.7
    (64, 6144, 4096, None): _plan(32, 128, 1, False, 4),  # 16.6/17.9
    # H200, 2026-11-27 (strips of 128 added to the 64-row sweep): each strip re-reads the 64 rows of x
    (64, 28672, 4096, 128): _plan(128, 128, 1, False, 4),  # 39.9/50.6
    (64, 28672, 4096, None): _plan(64, 128, 1, False, 4),  # 52.7/56.5
    (64, 4096, 14336, None): _plan(32, 128, 2, False, 4),  # 40.2/43.7
    (64, 2048, 4096, 128): _plan(32, 128, 4, False, 4),  # 10.4/10.7
    # H200, 2026-11-28, chosen inside the Llama-3-8B b=64 step (benchmarks/plan_tune.py, graph replay us,
    # plan / plan before): qkv 32-wide strips 5407 / 5491 (64-wide); down 3 stages 5341 / 5411 (the rule's 4)
    # H200, 2026-11-29, chosen again in that step with the norms, the attention and SiLU-and-mul writing the GEMMs'
    # input quantized (KernelConfig.fuse_fp8_quant): qkv 5 stages 5173 / 5209, o split 4 5079 / 5178, down 64-wide
    # strips 5024 / 5081; the three together 5.140 / 5.302 ms a step in benchmarks.ab_decode (RESULTS.md)
    (64, 6144, 4096, 128): dict(_plan(32, 128, 2, False, 4), num_stages=5),
    (64, 4096, 4096, 128): _plan(32, 128, 4, False, 4),
    (64, 4096, 14336, 128): dict(_plan(64, 128, 4, False, 4), num_stages=3),
}


def default_plan(bucket: int, n: int, k: int, block_k: int | None, sms: int = 132) -> dict:
    """The rule: weight tiles of 4-8 KB (BLOCK_K the K block when block-scaled, 128-512 deep
    per-channel), 16-32 column strips; K split in two until the grid has ~2 programs per SM, while
    a split stays >= 4 tiles deep and the float32 partials (split x rows x 4 B, written and read
    per column) stay under a quarter of the weight's K bytes per column; the activation
    quantized by the launch ahead (in the GEMM, measured on cold weights at 1 row, it won by at
    most 1.5 us on a 2048-wide K and lost up to 2.8x per-channel, where every program reads its
    rows' whole K first: PLANS turns it on where it won)."""
    bn = 16 if bucket == 16 and block_k is None else 32
    bk = block_k if block_k else {16: 512, 32: 256, 64: 128}[bucket]
    strips = triton.cdiv(n, bn)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 4 * bk and 2 * split * bucket * 32 <= k and split < 16:
        split *= 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, QUANT=False, num_warps=4 if bucket == 64 else 2,
                num_stages=4)


def swap_plan(bucket: int, n: int, k: int, block_k: int | None, sms: int = 132) -> dict:
    """The rule for SWAP tiles (the weight as the wgmma's M side): 64-column strips, one warpgroup;
    K tiles and the split as default_plan's."""
    bk = block_k if block_k else 256
    strips = triton.cdiv(n, 64)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 4 * bk and split < 16:
        split *= 2
    return dict(BLOCK_N=64, BLOCK_K=bk, SPLIT_K=split, QUANT=False, num_warps=4, num_stages=4, SWAP=True)


def plan(m: int, n: int, k: int, block_k: int | None, sms: int = 132) -> dict:
    """The tile plan for m <= MAX_ROWS rows of x @ w.T, w [N, K] (block_k: the weight's K block,
    None per-channel). At 64 rows two weight tiles come before the PDL wait (PRELOAD), not one:
    the Llama-3-8B FP8 step at b=64 took 5.99 ms against 6.11 / 6.16 ms before and after it in
    one call (H200, 2026-11-27); at b=1 3.050 against 3.034 / 3.030 ms, so 16 rows keep one,
    except where a PLANS entry puts all of a program's tiles (2-4) before the wait with one stage."""
    bucket = row_bucket(m)
    p = dict(PLANS.get((bucket, n, k, block_k)) or default_plan(bucket, n, k, block_k, sms))
    return dict(p, PRELOAD=2) if bucket == 64 else p


def plans(shapes: list[tuple[int, int]], block_k: int | None, sms: int = 132) -> list[tuple[int, dict]]:
    """Every (row bucket, plan) the weights [N, K] in `shapes` can take (the sm_90 compile test
    enumerates them; compile-ahead reaches them by running a batch per row bucket: fp8.plan_key)."""
    out = []
    for bucket in ROW_BUCKETS:
        for n, k in shapes:
            p = plan(bucket, n, k, block_k, sms)
            if (bucket, p) not in out:
                out.append((bucket, p))
    return out


def supports(m: int, block: tuple[int, int] | None) -> bool:
    """Whether the decode tile takes m rows of this weight layout (block-scaled: a K block of
    32..512, one tile per group)."""
    return 0 < m <= MAX_ROWS and (block is None or 32 <= block[1] <= 512)


def fp8_skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                             block: tuple[int, int] | None, cfg: dict | None = None,
                             pdl: bool = True, quantized: torch.Tensor | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """kernels.fp8.fp8_linear_ref for x: [M, K] bf16/fp16, M <= MAX_ROWS; w: [N, K] fp8 with
    w_scale [N] (block None) or [ceil(N / bn), ceil(K / bk)] -> [M, N] in x.dtype. quantized: x is
    already quantized (fp8, as quantize_rows_triton writes it) with these scales, the output in dtype;
    the plan must be one that quantizes ahead (QUANT off)."""
    return _launch(x, w, w_scale, block, cfg, pdl, quantized=None if quantized is None else (quantized, dtype))[0]


def fp8_skinny_add_norm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, cfg: dict | None = None, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 GEMM ahead of an RMSNorm, as kernels/triton/linear.py's skinny_linear_add_norm_triton:
    x: [M, K], M <= 16; residual: [M, N]; norm_weight: [N] -> (s = x @ w.T + residual,
    sg = s * norm_weight, ss [16, strips] float32 each strip's sums of squares of s's rows)."""
    m, n = x.shape[0], w.shape[0]
    if m > NORM_ROWS or residual.shape != (m, n) or norm_weight.shape != (n,):
        raise ValueError(f"fp8 skinny add_norm: output ({m}, {n}) (at most {NORM_ROWS} rows), residual "
                         f"{tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}")
    return _launch(x, w, w_scale, block, cfg, pdl, norm_out=(residual, norm_weight))


def fp8_skinny_normed_triton(sg: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
                             ss: torch.Tensor, eps: float, cfg: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """The FP8 GEMM after (NORM_IN): sg, ss from a GEMM ahead that left the norm pending (ss [16,
    strips] float32) -> rms_norm(s) @ w.T, [M, N]."""
    if sg.shape[0] > NORM_ROWS or ss.dim() != 2 or ss.shape[0] != NORM_ROWS or ss.dtype != torch.float32:
        raise ValueError(f"fp8 skinny normed: sg {tuple(sg.shape)} (at most {NORM_ROWS} rows), ss "
                         f"{tuple(ss.shape)} {ss.dtype}, expected [{NORM_ROWS}, strips] float32")
    return _launch(sg, w, w_scale, block, cfg, pdl, norm_in=(ss, eps))[0]


def _launch(x, w, w_scale, block, cfg, pdl, norm_out=None, norm_in=None, quantized=None):
    m, k = x.shape
    n = w.shape[0]
    if not supports(m, block) or w.shape[1] != k:
        raise ValueError(f"fp8 skinny GEMM: x {tuple(x.shape)} (1..{MAX_ROWS} rows), weight {tuple(w.shape)}, "
                         f"block {block}")
    cfg = dict(cfg or plan(m, n, k, block[1] if block else None, num_sms(x.device)))
    bucket = row_bucket(m)
    split = cfg.pop("SPLIT_K")
    quant = cfg.pop("QUANT")
    if block is not None and cfg["BLOCK_K"] != block[1]:
        raise ValueError(f"fp8 skinny GEMM: block-scaled plans take BLOCK_K = the K block {block[1]}")
    strips = triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1 and strips > MAX_TICKETS:
        split = 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    if quantized is not None and (quant or norm_out is not None or norm_in is not None):
        raise ValueError("fp8 skinny GEMM: rows quantized ahead take a plan without QUANT and no pending norm")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype if quantized is None else quantized[1])
    sg = torch.empty_like(out) if norm_out is not None else out
    # every strip writes its column for all 16 rows (zeros past M)
    ss = torch.empty(NORM_ROWS, strips, device=x.device, dtype=torch.float32) if norm_out is not None else out
    xs = x  # (unused with QUANT)
    if quantized is not None:
        xs = quantized[0]
    elif not quant:
        x, xs = quantize_rows_triton(x, w.dtype, block[1] if block else None, pdl)
    w_scale = w_scale.contiguous()
    part = torch.empty(split, bucket, n, device=x.device, dtype=torch.float32) if split > 1 else out
    residual, norm_weight = norm_out if norm_out is not None else (out, out)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    ss_in, eps = norm_in if norm_in is not None else (out, 0.0)
    _fp8_skinny_kernel[(strips, split)](
        x, xs, w, w_scale, out, part, tickets(x.device), m, n, k, x.stride(0), xs.stride(0), w.stride(0),
        w_scale.stride(0) if block else 1, out.stride(0), block[0] if block else 1,
        float(torch.finfo(w.dtype).max), residual, norm_weight, sg, ss, ss_in,
        ss_in.shape[1] if norm_in is not None else 1, eps, residual.stride(0), sg.stride(0),
        BLOCK_M=bucket, SPLIT_K=split, EVEN_K=k % (split * cfg["BLOCK_K"]) == 0, PER_CHANNEL=block is None,
        QUANT=quant, NORM_OUT=norm_out is not None, NORM_IN=norm_in is not None,
        S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in is not None else 1,
        W_SCALAR=w_scalar(block, cfg["BLOCK_N"]), **cfg, **launch_args(x, pdl))
    return out, sg, ss


# ---- activation quantization launched ahead of a GEMM (the prefill tile's; the decode tile's
# when its plan does not quantize in the GEMM) ----------------------------------------------

@triton.jit
def _skip_row(row, block_rows_ptr, BLOCK_ROWS: tl.constexpr):
    """With BLOCK_ROWS (rows grouped in blocks of that many, block_rows_ptr each block's real row
    count, as kernels/triton/moe_align.py writes them): whether row is a block's padding."""
    if BLOCK_ROWS > 0:
        return row % BLOCK_ROWS >= tl.load(block_rows_ptr + row // BLOCK_ROWS)
    return False


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sg, fp8_max, block_rows_ptr,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, PDL: tl.constexpr,
                       EARLY: tl.constexpr = False):
    """Program (row, group): s = amax(|x|) / fp8_max over the group's GROUP columns, q = x / s
    (rows past M: q = 0, s = the floor 1e-12; their mask is a tensor, `cols * 0 + row < M`, as
    Triton's interpreter takes no scalar in a mask). A padding row (_skip_row) is left unwritten."""
    wait_previous(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    if _skip_row(row, block_rows_ptr, BLOCK_ROWS):
        return
    grp = tl.program_id(1)
    lo = grp * GROUP
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, GROUP, BLOCK):
        cols = lo + c0 + tl.arange(0, BLOCK)
        mask = (cols < K) & (c0 + tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask & (cols * 0 + row < M), other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, 1e-12)
    tl.store(s_ptr + row * stride_sm + grp * stride_sg, scale)
    for c0 in range(0, GROUP, BLOCK):
        cols = lo + c0 + tl.arange(0, BLOCK)
        mask = (cols < K) & (c0 + tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask & (cols * 0 + row < M), other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sg, G, fp8_max,
                         block_rows_ptr, GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """Program (row, GROUPS consecutive groups of GROUP columns): each group's scale and values in
    one pass, the tile held in registers (_quant_tile, as the decode GEMM does); rows past M and
    padding rows as _quant_rows_kernel's."""
    wait_previous(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    if _skip_row(row, block_rows_ptr, BLOCK_ROWS):
        return
    gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (cols < K) & (gi < G)[:, None]
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask & (cols * 0 + row < M), other=0.0).to(tl.float32)
    q, s = _quant_tile(x, fp8_max, q_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_sm + gi * stride_sg, s, mask=gi < G)
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype, group: int | None, pdl: bool = False,
                         rows: int | None = None, scales_by_column: bool = False,
                         blocks: tuple[torch.Tensor, int] | None = None, early: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.fp8.quantize_rows on the GPU. x: [M, K] -> (q [R, K] dtype, s [R, G] float32), R =
    rows (>= M; the rows past M are zeros with scale 1e-12: the padding torch's block-wise GEMM
    wants, written by this launch rather than by a copy) or M. scales_by_column: s is a
    column-major view (stride (1, R)), the layout of torch's block-wise activation scales.
    Groups of a power of two <= 1024 columns: 1024 columns a program, one pass; per token: a
    program per row, two passes over it. pdl: launched with PDL (the decode GEMM's, which is).
    blocks: (block_rows, BLOCK_M), x's rows grouped by expert as kernels/triton/moe_align.py lays
    them out: only each block's first block_rows[b] rows are quantized, the padding rows (which the
    expert GEMMs do not read) are left unwritten in q and s. early: the next launch let in before this one's
    PDL wait (kernels/triton/pdl.py)."""
    m, k = x.shape
    r = max(rows or m, m)
    group = group or k
    g = triton.cdiv(k, group)
    q = torch.empty(r, k, device=x.device, dtype=dtype)
    s = torch.empty(g, r, device=x.device, dtype=torch.float32).t() if scales_by_column else (
        torch.empty(r, g, device=x.device, dtype=torch.float32))
    if not r:
        return q, s
    fmax = float(torch.finfo(dtype).max)
    strides = (x.stride(0), q.stride(0), s.stride(0), s.stride(1))
    block_rows, block_m = blocks if blocks is not None else (s, 0)
    if group <= 1024 and group & (group - 1) == 0:
        groups = 1024 // group
        _quant_groups_kernel[(r, triton.cdiv(g, groups))](x, q, s, m, k, *strides, g, fmax, block_rows, GROUP=group,
                                                          GROUPS=groups, BLOCK_ROWS=block_m, EARLY=early,
                                                          num_warps=4, **launch_args(x, pdl))
    else:
        block = min(1024, triton.next_power_of_2(group))
        _quant_rows_kernel[(r, g)](x, q, s, m, k, *strides, fmax, block_rows, GROUP=group, BLOCK=block,
                                   BLOCK_ROWS=block_m, EARLY=early, num_warps=4, **launch_args(x, pdl))
    return q, s

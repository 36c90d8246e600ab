"""y = x @ w.T for a few rows of x (decode batches): a Triton GEMM whose grid covers the weight.

At batch 1-16 a linear layer is a read of its weight: the kernel gives each program a strip of
BLOCK_N output columns and, where the strips alone leave SMs idle, a share of K as well
(SPLIT_K). Split programs write float32 partials; the last program of a strip to take a ticket
sums them and writes the output, then puts the ticket back to 0, so one launch does both and the
ticket buffer is clean for the next call. Launched with programmatic dependent launch where the
GPU has it (kernels/triton/pdl.py), like the norms and activations around it.

The RMSNorm between two decode GEMMs (o_proj, then the MLP's first GEMM) can ride on both instead
of a launch of its own. NORM_OUT (the GEMM ahead): the strip's output plus the residual is the
new residual s, written as the output; s times the norm weight (rounded) goes to sg_ptr; the
strip's share of each row's sum of squares of s to ss_ptr[row, strip]. NORM_IN (the GEMM after,
whose A is that sg): after the wait it sums the row's partials into rstd = rsqrt(mean(s^2) + eps)
and scales its output by it, which commutes with the dot. No per-tile work on either side, so
wide GEMMs pay nothing per program for it (a norm folded into the A tiles makes every program
redo it). Rounding differs from norm-then-GEMM by about one bf16 rounding of the input.

FP8 weights (W8A16; kernels/fp8.py's layouts): the weight tiles are read as fp8 and converted to
the activations' dtype for the dot, so a decode step reads half the bytes and quantizes nothing.
W_SCALE 1 (per channel): the sum is scaled by the column's scale at the end; 2 (block): each K
tile (BLOCK_K divides the K block) is scaled on the accumulator by its columns' block scales; 3
(block, the strip inside one row block of the scale grid): by the strip's one scale, loaded once
as a scalar (w8_scale_kind).
FAST_CVT (CUDA, bf16 activations, e4m3): the conversion is integer ops (kernels/triton/e4m3.py)
instead of the cvt instructions, whose throughput kept the W8A16 GEMM below the HBM rate.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, num_sms, tickets
from tandem.kernels.triton.e4m3 import E4M3_BF16_UNIT, e4m3_to_bf16_scaled, fast_cvt
from tandem.kernels.triton.pdl import launch_args, wait_previous

MAX_ROWS = 16


@triton.jit
def _weight_tile(w_ptrs, k_left, n_mask, rk, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
    return tl.load(w_ptrs, mask=n_mask[None, :] & (rk < k_left)[:, None], other=0.0)


@triton.jit
def _x_tile(x_ptrs, k_left, m_mask, rk, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
    return tl.load(x_ptrs, mask=m_mask[:, None] & (rk < k_left)[None, :], other=0.0)


@triton.jit
def w_scale_ptrs(ws_ptr, rn, row0, rows_per_scale, stride_wsn, W_SCALE: tl.constexpr):
    """Where w_scales reads for the strip of weight rows rn starting at row0: the rows' rows of the
    scale grid [BN], or with W_SCALE 3 the strip's one row (a scalar pointer)."""
    if W_SCALE == 3:
        ptrs = ws_ptr + (row0 // rows_per_scale).to(tl.int64) * stride_wsn
    else:
        ptrs = ws_ptr + (rn // rows_per_scale).to(tl.int64) * stride_wsn
    return ptrs


@triton.jit
def w_scales(ws_ptrs, k0, K, k_per_scale, n_mask, W_SCALE: tl.constexpr):
    """The scales dot_w multiplies the weight tile at k0 by: with W_SCALE 2 those of its K block
    (k0 // k_per_scale, kept inside the grid for a split past K) at ws_ptrs [BN] (the columns' rows
    of the scale grid), with 3 the strip's one (ws_ptrs scalar, w_scale_ptrs); otherwise unused
    (ones). The K loops load them a tile ahead of their dot_w: Triton's pipeliner leaves a scale
    load inside the loop synchronous, and each tile then waited for it (an L2 or HBM round trip)
    before the next tile's loads were issued."""
    if W_SCALE >= 2:
        s = block_scales(ws_ptrs, tl.minimum(k0, K - 1) // k_per_scale, n_mask, W_SCALE == 3)
    else:
        s = n_mask.to(tl.float32)
    return s


@triton.jit
def block_scales(ws_ptrs, kb, n_mask, SCALAR: tl.constexpr):
    """K block kb's weight scales: with SCALAR the strip's one (ws_ptrs a scalar: the strip lies
    inside one row block of the scale grid), else the columns' [BN] at ws_ptrs."""
    if SCALAR:
        s = tl.load(ws_ptrs + kb)
    else:
        s = tl.load(ws_ptrs + kb, mask=n_mask, other=0.0)
    return s


@triton.jit
def dot_w(acc, a, w, s, W_SCALE: tl.constexpr, FAST_CVT: tl.constexpr = False):
    """acc + a @ w for a weight tile w [BK, BN] in a's dtype or fp8 (converted to a's dtype): with
    W_SCALE 2 times its K block's scales s [BN] (w_scales), with 3 times the scalar s; W_SCALE 0 / 1
    unscaled (per-channel: the caller scales the sum). FAST_CVT: w converted by e4m3_to_bf16_scaled,
    so acc is in units of 1 / E4M3_BF16_UNIT (the caller scales it back)."""
    wa = e4m3_to_bf16_scaled(w) if FAST_CVT else w.to(a.dtype)
    if W_SCALE == 3:
        out = acc + tl.dot(a, wa) * s
    elif W_SCALE == 2:
        out = acc + tl.dot(a, wa) * s[None, :]
    else:
        out = tl.dot(a, wa, acc)
    return out


@triton.jit
def scale_back(acc, ws_ptrs, n_mask, W_SCALE: tl.constexpr, FAST_CVT: tl.constexpr):
    """A sum of dot_w tiles in the weight's units: undoes FAST_CVT's 1 / E4M3_BF16_UNIT and applies
    the per-channel scales (W_SCALE 1; block scales went in per tile)."""
    if FAST_CVT:
        acc *= E4M3_BF16_UNIT
    if W_SCALE == 1:
        acc *= tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    return acc


def w8_scale_kind(kind: int, block: tuple[int, int] | None, *strips: tuple[int, int]) -> int:
    """W_SCALE for a kernel whose weight strips of (width, first row offset) all lie inside one row
    block of the scale grid: 3 (one scalar scale a strip and K block) where kind is 2 (block) and
    each strip width divides the block's rows and its offset, else kind."""
    if kind == 2 and all(block[0] % bn == 0 and off % bn == 0 for bn, off in strips):
        return 3
    return kind


def w8_scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None,
                  placeholder: torch.Tensor) -> tuple[tuple, int]:
    """dot_w's (ws, stride of ws's output-row dim, rows_per_scale, k_per_scale) and W_SCALE for fp8
    weight scales [..., N] (per channel, block None) or [..., N / bn, K / bk] (block); for a bf16
    weight (scale None) placeholders and W_SCALE 0."""
    if scale is None:
        return (placeholder, 0, 1, 1), 0
    scale = scale.contiguous()
    if block is None:
        return (scale, 1, 1, 1), 1
    return (scale, scale.stride(-2), block[0], block[1]), 2


@triton.jit
def pend_norm(s, g, mask):
    """The producer side of a pending RMSNorm (NORM_OUT; also the MoE top-k sum): for the new
    residual s (the output plus the residual, rounded to the output dtype as the reference rounds
    the GEMM's output first), s * g rounded and the sums of squares of s along the last axis
    (columns outside mask count 0). g is float32; g and mask broadcast to s."""
    sf = tl.where(mask, s.to(tl.float32), 0.0)
    sumsq = tl.sum(sf * sf, axis=-1)
    return (sf * g).to(s.dtype), sumsq


@triton.jit
def pending_rstd(ss_ptr, rows, row_mask, strips, K, eps, S_PAD: tl.constexpr):
    """The consumer side (NORM_IN): each row's rsqrt(mean(s^2) + eps) over K columns, from the
    producer's [rows, strips] partial sums of squares (S_PAD >= strips)."""
    sp = tl.arange(0, S_PAD)
    ss = tl.load(ss_ptr + rows[:, None] * strips + sp[None, :], mask=row_mask[:, None] & (sp < strips)[None, :],
                 other=0.0)
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _write_out(out_ptrs, acc, out_mask, rm, n_mask, pid_n, r, g, sg_ptrs, ss_ptr, strips,
               NORM_OUT: tl.constexpr):
    """The strip's output; with NORM_OUT, out = s = acc + residual r (the GEMM's output rounded
    first, like the reference), sg = s * g and the strip's sums of squares of s (pend_norm)."""
    y = acc.to(out_ptrs.dtype.element_ty)
    if NORM_OUT:
        s = (y.to(tl.float32) + r).to(y.dtype)
        tl.store(out_ptrs, s, mask=out_mask)
        sg, sumsq = pend_norm(s, g[None, :], n_mask[None, :])
        tl.store(ss_ptr + rm * strips + pid_n, sumsq)
        tl.store(sg_ptrs, sg, mask=out_mask)
    else:
        tl.store(out_ptrs, y, mask=out_mask)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    res_ptr, g_ptr, sg_ptr, ss_ptr, ss_in_ptr, in_strips, eps, stride_rm, stride_gm,
    ws_ptr, stride_wsn, rows_per_scale, k_per_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRELOAD: tl.constexpr, NORM_OUT: tl.constexpr, NORM_IN: tl.constexpr,
    S_PAD: tl.constexpr, W_SCALE: tl.constexpr, FAST_CVT: tl.constexpr, PDL: tl.constexpr,
):
    """PRELOAD: the first weight tile is loaded before waiting for the kernel ahead (PDL): it does
    not depend on it, and the kernel ahead (a norm, the attention merge) leaves HBM idle
    meanwhile. (Two tiles measured slower.)
    NORM_OUT / NORM_IN (ss_in_ptr [rows, in_strips] partials, S_PAD >= in_strips): see the module
    docstring. W_SCALE: fp8 weights with scales ws [N / rows_per_scale] (1) or [N / rows_per_scale,
    K / k_per_scale] (2), module docstring."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
    ws_ptrs = w_scale_ptrs(ws_ptr, rn, pid_n * BLOCK_N, rows_per_scale, stride_wsn, W_SCALE)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k = k_lo
    if PRELOAD:
        w0 = _weight_tile(w_ptrs, k_hi - k, n_mask, rk, False)
    wait_previous(PDL)
    out_mask = m_mask[:, None] & n_mask[None, :]
    r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g = tl.zeros([BLOCK_N], dtype=tl.float32)
    if NORM_OUT:  # issued now, used by the epilogue
        r = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM_IN:
        rstd = pending_rstd(ss_in_ptr, rm, m_mask, in_strips, K, eps, S_PAD)
    w_s = w_scales(ws_ptrs, k, K, k_per_scale, n_mask, W_SCALE)
    if PRELOAD:
        a = _x_tile(x_ptrs, k_hi - k, m_mask, rk, False)
        w_s_next = w_scales(ws_ptrs, k + BLOCK_K, K, k_per_scale, n_mask, W_SCALE)
        acc = dot_w(acc, a, w0, w_s, W_SCALE, FAST_CVT)
        w_s = w_s_next
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k += BLOCK_K
    for k0 in range(k, k_hi, BLOCK_K):
        a = _x_tile(x_ptrs, k_hi - k0, m_mask, rk, EVEN_K)
        w_s_next = w_scales(ws_ptrs, k0 + BLOCK_K, K, k_per_scale, n_mask, W_SCALE)  # a tile ahead (w_scales)
        acc = dot_w(acc, a, _weight_tile(w_ptrs, k_hi - k0, n_mask, rk, EVEN_K), w_s, W_SCALE, FAST_CVT)
        w_s = w_s_next
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = scale_back(acc, ws_ptrs, n_mask, W_SCALE, FAST_CVT)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    sg_ptrs = sg_ptr + rm[:, None] * stride_gm + rn[None, :]
    strips = tl.num_programs(0)
    if SPLIT_K == 1:
        if NORM_IN:
            acc *= rstd[:, None]
        _write_out(out_ptrs, acc, out_mask, rm, n_mask, pid_n, r, g, sg_ptrs, ss_ptr, strips, NORM_OUT)
    else:
        # partials [SPLIT_K, BLOCK_M, N] float32; the strip's last program to finish sums them
        tl.store(part_ptr + (pid_k * BLOCK_M + rm[:, None]) * N + rn[None, :], acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (s * BLOCK_M + rm[:, None]) * N + rn[None, :], mask=out_mask,
                                 other=0.0, cache_modifier=".cg")
            if NORM_IN:
                total *= rstd[:, None]
            _write_out(out_ptrs, total, out_mask, rm, n_mask, pid_n, r, g, sg_ptrs, ss_ptr, strips, NORM_OUT)
            tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


# Measured bf16 plans: (N, K) -> plan, where one beat _config's rule inside a decode step
# (benchmarks/plan_tune.py); none yet.
SKINNY_PLANS: dict[tuple[int, int], dict] = {}


def _config(n: int, k: int, sms: int) -> dict:
    """SKINNY_PLANS' plan for [N, K], else the rule: 16-column strips; K split in two until the grid
    has ~2 programs per SM or a split would be under 256 deep; 256-deep K tiles where a split is
    >= 2048 deep. Near the best of a sweep of 48 plans for each Llama-8B and Qwen3-30B-A3B projection
    at M=1 (benchmarks/RESULTS.md)."""
    got = SKINNY_PLANS.get((n, k))
    if got:
        return dict(got)
    strips = triton.cdiv(n, 16)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 256 and split < 16:
        split *= 2
    return dict(BLOCK_N=16, BLOCK_K=256 if k // split >= 2048 else 128, SPLIT_K=split, num_warps=2, num_stages=4)


# Measured W8A16 plans: (N, K, the weight's K block or None per-channel) -> plan, the best of
# `python -m benchmarks.fp8_gemm --w8a16 --rows 1` (cold weights; H200, 2026-11-27) where it beat
# w8a16_config by >= 3%; the comments: us per call, that plan / the rule.
W8A16_PLANS: dict[tuple[int, int, int | None], dict] = {
    (6144, 4096, 128): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4),  # 12.2/13.0
    (28672, 4096, 128): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4),  # 40.3/43.8
    (4096, 14336, 128): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=4),  # 21.6/22.5
    (5120, 2048, 128): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=2, num_stages=4),  # 7.0/8.1
}


def w8a16_config(n: int, k: int, block_k: int | None, sms: int) -> dict:
    """The plan for fp8 weights: the bf16 rule's grid with strips twice as wide (each program's
    tiles then hold as many bytes as the bf16 GEMM's), BLOCK_K within the K block."""
    got = W8A16_PLANS.get((n, k, block_k))
    if got:
        return dict(got)
    strips = triton.cdiv(n, 32)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 256 and split < 16:
        split *= 2
    bk = 256 if k // split >= 2048 else 128
    return dict(BLOCK_N=32, BLOCK_K=min(bk, block_k) if block_k else bk, SPLIT_K=split, num_warps=2, num_stages=4)


def w8a16_plans(shapes: list[tuple[int, int]], block_k: int | None, sms: int = 132) -> list[dict]:
    """Every distinct W8A16 plan the weights [N, K] in `shapes` take (the sm_90 compile test)."""
    out = []
    for n, k in shapes:
        p = w8a16_config(n, k, block_k, sms)
        if p not in out:
            out.append(p)
    return out


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None,
                         pdl: bool = True, w_scale: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None, int_convert: bool = True) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS; weight: [N, K] -> x @ weight.T, [M, N] in x.dtype. cfg: a tile
    plan (benchmark sweeps; PRELOAD=False keeps the first weight tile behind the PDL wait).
    w_scale: the weight is fp8 with these scales (kernels/fp8.py layouts, `block`): W8A16 (e4m3 read
    by integer ops where int_convert and kernels/triton/e4m3.py fast_cvt allow)."""
    return _launch(x, weight, cfg, pdl, w8=(w_scale, block, int_convert))[0]


def skinny_linear_add_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    cfg: dict | None = None, pdl: bool = True, w_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None, int_convert: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMM ahead of an RMSNorm (NORM_OUT): x: [M, K]; weight: [N, K]; residual: [M, N];
    norm_weight: [N] -> (s = x @ weight.T + residual, sg = s * norm_weight, ss [MAX_ROWS, strips]
    float32: each strip's sums of squares of s's rows). w_scale, block: as skinny_linear_triton."""
    m, n = x.shape[0], weight.shape[0]
    if residual.shape != (m, n) or norm_weight.shape != (n,):
        raise ValueError(f"skinny_linear_add_norm: output ({m}, {n}), residual {tuple(residual.shape)}, "
                         f"norm weight {tuple(norm_weight.shape)}")
    return _launch(x, weight, cfg, pdl, norm_out=(residual, norm_weight), w8=(w_scale, block, int_convert))


def skinny_linear_normed_triton(
    sg: torch.Tensor, weight: torch.Tensor, ss: torch.Tensor, eps: float, cfg: dict | None = None,
    pdl: bool = True, w_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
    int_convert: bool = True,
) -> torch.Tensor:
    """The GEMM after (NORM_IN): sg, ss from skinny_linear_add_norm_triton -> rms_norm(s) @ weight.T
    (sg @ weight.T times each row's rsqrt(mean(s^2) + eps)). w_scale, block: as skinny_linear_triton."""
    if ss.dim() != 2 or ss.shape[0] != MAX_ROWS or ss.dtype != torch.float32:
        raise ValueError(f"skinny_linear_normed: ss {tuple(ss.shape)} {ss.dtype}, expected [{MAX_ROWS}, strips] float32")
    return _launch(sg, weight, cfg, pdl, norm_in=(ss, eps), w8=(w_scale, block, int_convert))[0]


def _launch(x, weight, cfg, pdl, norm_out=None, norm_in=None, w8=(None, None, True)):
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows), weight {tuple(weight.shape)}")
    w_scale, block, int_convert = w8
    ws_args, w_scale_kind = w8_scale_args(w_scale, block, weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if cfg is None:
        sms = num_sms(x.device)
        cfg = w8a16_config(n, k, block[1] if block else None, sms) if w_scale is not None else _config(n, k, sms)
    cfg = dict(cfg)
    if w_scale_kind == 2 and block[1] % cfg["BLOCK_K"]:
        raise ValueError(f"skinny_linear: BLOCK_K {cfg['BLOCK_K']} must divide the weight's K block {block[1]}")
    split = cfg.pop("SPLIT_K")
    strips = triton.cdiv(n, cfg["BLOCK_N"])
    w_scale_kind = w8_scale_kind(w_scale_kind, block, (cfg["BLOCK_N"], 0))
    sg = torch.empty_like(out) if norm_out is not None else out
    # every strip writes its column for all MAX_ROWS rows (zeros past M)
    ss = torch.empty(MAX_ROWS, strips, device=x.device, dtype=torch.float32) if norm_out is not None else out
    if m == 0:
        return out, sg, ss
    if split > 1 and strips > MAX_TICKETS:
        split = 1
    part = torch.empty(split, MAX_ROWS, n, device=x.device, dtype=torch.float32) if split > 1 else out
    residual, norm_weight = norm_out if norm_out is not None else (out, out)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    ss_in, eps = norm_in if norm_in is not None else (out, 0.0)
    _skinny_gemm_kernel[(strips, split)](
        x, weight, out, part, tickets(x.device), m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        residual, norm_weight, sg, ss, ss_in, ss_in.shape[1] if norm_in is not None else 1, eps,
        residual.stride(0), sg.stride(0), *ws_args,
        BLOCK_M=MAX_ROWS, SPLIT_K=split, EVEN_K=k % (split * cfg["BLOCK_K"]) == 0,
        PRELOAD=cfg.pop("PRELOAD", True), NORM_OUT=norm_out is not None, NORM_IN=norm_in is not None,
        S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in is not None else 1, W_SCALE=w_scale_kind,
        FAST_CVT=w_scale is not None and int_convert and fast_cvt(x, weight), **cfg, **launch_args(x, pdl),
    )
    return out, sg, ss

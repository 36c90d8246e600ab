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
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, num_sms, tickets
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRELOAD: tl.constexpr, NORM_OUT: tl.constexpr, NORM_IN: tl.constexpr,
    S_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """PRELOAD: the first weight tile is loaded before waiting for the kernel ahead (PDL): it does
    not depend on it, and the kernel ahead (a norm, the attention merge) leaves HBM idle
    meanwhile. (Two tiles measured slower.)
    NORM_OUT / NORM_IN (ss_in_ptr [rows, in_strips] partials, S_PAD >= in_strips): see the module
    docstring."""
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
    if PRELOAD:
        a = _x_tile(x_ptrs, k_hi - k, m_mask, rk, False)
        acc = tl.dot(a, w0, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k += BLOCK_K
    for k0 in range(k, k_hi, BLOCK_K):
        a = _x_tile(x_ptrs, k_hi - k0, m_mask, rk, EVEN_K)
        acc = tl.dot(a, _weight_tile(w_ptrs, k_hi - k0, n_mask, rk, EVEN_K), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
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


def _config(n: int, k: int, sms: int) -> dict:
    """16-column strips; K split in two until the grid has ~2 programs per SM or a split would be
    under 256 deep; 256-deep K tiles where a split is >= 2048 deep. Near the best of a sweep of 48
    plans for each Llama-8B and Qwen3-30B-A3B projection at M=1 (benchmarks/RESULTS.md)."""
    strips = triton.cdiv(n, 16)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 256 and split < 16:
        split *= 2
    return dict(BLOCK_N=16, BLOCK_K=256 if k // split >= 2048 else 128, SPLIT_K=split, num_warps=2, num_stages=4)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None,
                         pdl: bool = True) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS; weight: [N, K] -> x @ weight.T, [M, N] in x.dtype. cfg: a tile
    plan (benchmark sweeps; PRELOAD=False keeps the first weight tile behind the PDL wait)."""
    return _launch(x, weight, cfg, pdl)[0]


def skinny_linear_add_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    cfg: dict | None = None, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMM ahead of an RMSNorm (NORM_OUT): x: [M, K]; weight: [N, K]; residual: [M, N];
    norm_weight: [N] -> (s = x @ weight.T + residual, sg = s * norm_weight, ss [MAX_ROWS, strips]
    float32: each strip's sums of squares of s's rows)."""
    m, n = x.shape[0], weight.shape[0]
    if residual.shape != (m, n) or norm_weight.shape != (n,):
        raise ValueError(f"skinny_linear_add_norm: output ({m}, {n}), residual {tuple(residual.shape)}, "
                         f"norm weight {tuple(norm_weight.shape)}")
    return _launch(x, weight, cfg, pdl, norm_out=(residual, norm_weight))


def skinny_linear_normed_triton(
    sg: torch.Tensor, weight: torch.Tensor, ss: torch.Tensor, eps: float, cfg: dict | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """The GEMM after (NORM_IN): sg, ss from skinny_linear_add_norm_triton -> rms_norm(s) @ weight.T
    (sg @ weight.T times each row's rsqrt(mean(s^2) + eps))."""
    if ss.dim() != 2 or ss.shape[0] != MAX_ROWS or ss.dtype != torch.float32:
        raise ValueError(f"skinny_linear_normed: ss {tuple(ss.shape)} {ss.dtype}, expected [{MAX_ROWS}, strips] float32")
    return _launch(sg, weight, cfg, pdl, norm_in=(ss, eps))[0]


def _launch(x, weight, cfg, pdl, norm_out=None, norm_in=None):
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows), weight {tuple(weight.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    cfg = dict(cfg or _config(n, k, num_sms(x.device)))
    split = cfg.pop("SPLIT_K")
    strips = triton.cdiv(n, cfg["BLOCK_N"])
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
        residual.stride(0), sg.stride(0),
        BLOCK_M=MAX_ROWS, SPLIT_K=split, EVEN_K=k % (split * cfg["BLOCK_K"]) == 0,
        PRELOAD=cfg.pop("PRELOAD", True), NORM_OUT=norm_out is not None, NORM_IN=norm_in is not None,
        S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in is not None else 1, **cfg, **launch_args(x, pdl),
    )
    return out, sg, ss

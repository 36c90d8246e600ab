"""y = x @ w.T for a few rows of x (decode batches): a Triton GEMM whose grid covers the weight.

At batch 1-16 a linear layer is a read of its weight: the kernel gives each program a strip of
BLOCK_N output columns and, where the strips alone leave SMs idle, a share of K as well
(SPLIT_K). Split programs write float32 partials; the last program of a strip to take a ticket
sums them and writes the output, then puts the ticket back to 0, so one launch does both and the
ticket buffer is clean for the next call. Launched with programmatic dependent launch where the
GPU has it (kernels/triton/pdl.py), like the norms and activations around it.
"""
import torch
import triton
import triton.language as tl

from kernels.triton.device import MAX_TICKETS, num_sms, tickets
from kernels.triton.pdl import launch_args, wait_previous

MAX_ROWS = 16
_PRELOAD = True  # the first weight tile before the wait (H100: -0.06 ms a Llama-8B b=1 step; RESULTS)


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
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
):
    """PRELOAD: the first weight tile is loaded before waiting for the kernel ahead (PDL): it does
    not depend on it, and the kernel ahead (a norm, the attention merge) leaves HBM idle
    meanwhile. (Two tiles measured slower; benchmarks/notes_kernels.md, seventh round.)"""
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
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
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
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def _config(n: int, k: int, sms: int) -> dict:
    """16-column strips; K split in two until the grid has ~2 programs per SM or a split would be
    under 256 deep; 256-deep K tiles where a split is >= 2048 deep. From an H100 sweep at M=1
    (benchmarks/notes_kernels.md, seventh round): Llama-8B and Qwen3-30B-A3B projections within
    ~0.5 us of the best of 48 plans each."""
    strips = triton.cdiv(n, 16)
    split = 1
    while strips * split < 2 * sms and k // (2 * split) >= 256 and split < 16:
        split *= 2
    return dict(BLOCK_N=16, BLOCK_K=256 if k // split >= 2048 else 128, SPLIT_K=split, num_warps=2, num_stages=4)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS; weight: [N, K] -> x @ weight.T, [M, N] in x.dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows), weight {tuple(weight.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    cfg = dict(cfg or _config(n, k, num_sms(x.device)))
    split = cfg.pop("SPLIT_K")
    strips = triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1 and strips > MAX_TICKETS:
        split = 1
    part = torch.empty(split, MAX_ROWS, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _skinny_gemm_kernel[(strips, split)](
        x, weight, out, part, tickets(x.device), m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, SPLIT_K=split, EVEN_K=k % (split * cfg["BLOCK_K"]) == 0,
        PRELOAD=cfg.pop("PRELOAD", _PRELOAD), **cfg, **launch_args(x),
    )
    return out

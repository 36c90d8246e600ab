"""Row argmax of a [N, V] float matrix in one launch (greedy sampling over a vocabulary).

Each row is cut into SPLITS chunks of at most BLOCK columns, a program per chunk; the row's last
program to finish (a ticket, kernels/triton/device.py) reduces the chunks' partials. Ties go to
the lowest index and a NaN counts as larger than any number, as in torch.argmax.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, tickets
from tandem.kernels.triton.pdl import launch_args, wait_previous

_BLOCK = 4096


@triton.jit
def _argmax_of(v, idx, BIG: tl.constexpr):
    """(value, index) of the first NaN of v if there is one, else of the first maximum."""
    nan = v != v
    first_nan = tl.min(tl.where(nan, idx, BIG), axis=0)
    clean = tl.where(nan, float("-inf"), v)
    best = tl.max(clean, axis=0)
    first_best = tl.min(tl.where(clean == best, idx, BIG), axis=0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, ticket_ptr, V, stride_x,
                   SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    # past the row's end: -inf at index >= V, never chosen over a column of the row
    v = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, best_i = _argmax_of(v, cols, 2**31 - 1)
    if SPLITS == 1:
        tl.store(out_ptr + row, best_i.to(tl.int64))
    else:
        tl.store(part_v_ptr + row * SPLITS + split, best)
        tl.store(part_i_ptr + row * SPLITS + split, best_i)
        if tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            s = tl.arange(0, S_PAD)
            pv = tl.load(part_v_ptr + row * SPLITS + s, mask=s < SPLITS, other=float("-inf"), cache_modifier=".cg")
            pi = tl.load(part_i_ptr + row * SPLITS + s, mask=s < SPLITS, other=0, cache_modifier=".cg")
            # chunks are in column order, so the first best chunk holds the first best column
            _, chunk = _argmax_of(pv, s, S_PAD)
            tl.store(out_ptr + row, tl.sum(tl.where(s == chunk, pi, 0), axis=0).to(tl.int64))
            tl.atomic_xchg(ticket_ptr + row, 0, sem="relaxed", scope="gpu")


def argmax_triton(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x: [N, V] float -> [N] int64, the index of each row's maximum (torch.argmax(x, -1))."""
    n, vocab = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    x = x if x.stride(-1) == 1 else x.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    splits = triton.cdiv(vocab, block)
    if splits > 1 and n > MAX_TICKETS:
        raise ValueError(f"argmax_triton: at most {MAX_TICKETS} rows, got {n}")
    part_v = torch.empty(n, splits, dtype=torch.float32, device=x.device)
    part_i = torch.empty(n, splits, dtype=torch.int32, device=x.device)
    _argmax_kernel[(splits, n)](x, out, part_v, part_i, tickets(x.device), vocab, x.stride(0),
                                SPLITS=splits, S_PAD=triton.next_power_of_2(splits), BLOCK=block, num_warps=8 if block >= 2048 else 4,
                                **launch_args(x, pdl))
    return out

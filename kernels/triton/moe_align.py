"""Grouping of MoE (token, slot) pairs by expert for kernels/triton/moe.py's grouped expert GEMMs.

The pairs are grouped by expert into blocks of BLOCK_M rows (each expert's run padded to a
multiple of BLOCK_M); a block holds one expert, so each expert GEMM program streams that expert's
weight tile once for all its rows. Small batches group in one Triton program, large ones in three
launches (count per chunk, prefix, scatter); no host sync either way. In one program an expert's
pairs take their rows in arrival order (atomics), in three launches in pair order. Pairs with a negative (or
out-of-range) expert id (experts owned elsewhere) are left out.

For max_blocks = cdiv(P, BLOCK_M) + min(E, P) blocks (P = T * top_k), _align returns:
  sorted_pairs:  [max_blocks * BLOCK_M] int32, pair index (token * top_k + slot) of each row
  block_expert:  [max_blocks] int32, the block's expert, -1 for an unused block
  block_rows:    [max_blocks] int32, how many leading rows of the block are real pairs
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, tickets
from tandem.kernels.triton.pdl import launch_args, wait_previous

_SMALL_PAIRS = 1024  # at most this many pairs: one-program grouping kernel
_CHUNK = 128  # pairs per program (large batches)

@triton.jit
def _rank_in_chunk(e, CHUNK: tl.constexpr):
    """For each pair of the chunk: how many earlier pairs of the chunk chose the same expert."""
    i = tl.arange(0, CHUNK)
    same = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _write_blocks(counts, block_expert_ptr, block_rows_ptr, max_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Expert segments padded to BLOCK_M rows -> each block's expert and real row count.
    Returns each expert's first row."""
    ex = tl.arange(0, E_PAD)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    total = tl.sum(padded, axis=0)
    for b0 in range(0, max_blocks, 64):
        b = b0 + tl.arange(0, 64)
        row0 = b * BLOCK_M
        # block b belongs to the first expert whose segment ends after row0
        expert = tl.sum((seg_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        is_mine = (ex[None, :] == expert[:, None]).to(tl.int32)
        real_end = tl.sum(is_mine * (seg_start + counts)[None, :], axis=1)
        rows = tl.minimum(tl.maximum(real_end - row0, 0), BLOCK_M)
        in_use = row0 < total
        tl.store(block_expert_ptr + b, tl.where(in_use, expert, -1), mask=b < max_blocks)
        tl.store(block_rows_ptr + b, tl.where(in_use, rows, 0), mask=b < max_blocks)
    return seg_start


@triton.jit
def _align_small_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, num_pairs, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, PAIRS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Whole grouping in one program (decode-sized batches, up to PAIRS pairs: one launch). Each pair
    takes its place among its expert's pairs from an atomic add on that expert's counter (counts_ptr:
    zeros between launches, kernels/triton/device.py tickets, put back to zero here), so an expert's
    pairs land in its rows in no fixed order between runs; which row a pair takes does not change what
    the expert GEMMs compute for it. The counters then hold each expert's first row while the pairs
    look theirs up."""
    wait_previous(PDL)
    p = tl.arange(0, PAIRS)
    e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    valid = (e >= 0) & (e < num_experts)
    rank = tl.atomic_add(counts_ptr + e, tl.full([PAIRS], 1, tl.int32), mask=valid, sem="relaxed")
    tl.debug_barrier()  # every pair counted (each atomic returned) before the counts are read
    ex = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + ex, cache_modifier=".cg")
    seg_start = _write_blocks(counts, block_expert_ptr, block_rows_ptr, max_blocks, BLOCK_M, E_PAD)
    tl.debug_barrier()
    tl.store(counts_ptr + ex, seg_start)
    tl.debug_barrier()
    start = tl.load(counts_ptr + e, mask=valid, other=0, cache_modifier=".cg")
    tl.store(sorted_ptr + start + rank, p, mask=valid)
    tl.debug_barrier()  # every pair has read its expert's first row before the counters go back to zero
    tl.store(counts_ptr + ex, tl.zeros([E_PAD], tl.int32))


@triton.jit
def _align_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, num_experts,
                        E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Large batches, step 1 of 3: per-chunk expert histogram [num_chunks, E_PAD]."""
    wait_previous(PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    ex = tl.arange(0, E_PAD)
    hit = ((e[:, None] == ex[None, :]) & (e[:, None] < num_experts)).to(tl.int32)
    tl.store(chunk_counts_ptr + c * E_PAD + ex, tl.sum(hit, axis=0))


@triton.jit
def _align_offsets_kernel(chunk_counts_ptr, seg_start_ptr, block_expert_ptr, block_rows_ptr,
                          num_chunks, max_blocks,
                          BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """Step 2 (one program): chunk counts -> exclusive prefix per expert (in place), segments."""
    wait_previous(PDL)
    ex = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        ptrs = chunk_counts_ptr + r[:, None] * E_PAD + ex[None, :]
        cnt = tl.load(ptrs, mask=(r < num_chunks)[:, None], other=0)
        tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + running[None, :], mask=(r < num_chunks)[:, None])
        running += tl.sum(cnt, axis=0)
    seg_start = _write_blocks(running, block_expert_ptr, block_rows_ptr, max_blocks, BLOCK_M, E_PAD)
    tl.store(seg_start_ptr + ex, seg_start)


@triton.jit
def _align_scatter_kernel(ids_ptr, chunk_base_ptr, seg_start_ptr, sorted_ptr, num_pairs, num_experts,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Step 3: each pair's row = segment start + pairs of its expert in earlier chunks + rank."""
    wait_previous(PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    valid = (e >= 0) & (e < num_experts)
    start = tl.load(seg_start_ptr + e, mask=valid, other=0)
    before = tl.load(chunk_base_ptr + c * E_PAD + e, mask=valid, other=0)
    tl.store(sorted_ptr + start + before + _rank_in_chunk(e, CHUNK), p, mask=valid)


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int, max_blocks: int, pdl: bool):
    """Group the (token, slot) pairs by expert; see the module docstring. No host sync."""
    dev, num_pairs = topk_ids.device, topk_ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    sorted_pairs = torch.empty(max_blocks * block_m, device=dev, dtype=torch.int32)
    block_expert = torch.empty(max_blocks, device=dev, dtype=torch.int32)
    block_rows = torch.empty(max_blocks, device=dev, dtype=torch.int32)
    if num_pairs <= _SMALL_PAIRS and e_pad <= MAX_TICKETS:
        _align_small_kernel[(1,)](
            topk_ids, tickets(dev), sorted_pairs, block_expert, block_rows, num_pairs, num_experts, max_blocks,
            BLOCK_M=block_m, E_PAD=e_pad, PAIRS=_SMALL_PAIRS, num_warps=8, **launch_args(topk_ids, pdl),
        )
        return sorted_pairs, block_expert, block_rows
    num_chunks = triton.cdiv(num_pairs, _CHUNK)
    chunk_counts = torch.empty(num_chunks, e_pad, device=dev, dtype=torch.int32)
    seg_start = torch.empty(e_pad, device=dev, dtype=torch.int32)
    _align_count_kernel[(num_chunks,)](topk_ids, chunk_counts, num_pairs, num_experts,
                                       E_PAD=e_pad, CHUNK=_CHUNK, num_warps=4, **launch_args(topk_ids, pdl))
    _align_offsets_kernel[(1,)](chunk_counts, seg_start, block_expert, block_rows, num_chunks,
                                max_blocks, BLOCK_M=block_m, E_PAD=e_pad, ROWS=16, num_warps=8,
                                **launch_args(topk_ids, pdl))
    _align_scatter_kernel[(num_chunks,)](topk_ids, chunk_counts, seg_start, sorted_pairs, num_pairs,
                                         num_experts, E_PAD=e_pad, CHUNK=_CHUNK, num_warps=4,
                                         **launch_args(topk_ids, pdl))
    return sorted_pairs, block_expert, block_rows

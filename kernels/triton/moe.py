"""Fused MoE experts in Triton: align -> grouped GEMM w13 + SiLU-mul -> grouped GEMM w2 -> sum.

Same contract as `kernels.moe.fused_experts_ref`. The (token, slot) pairs are grouped by expert
into blocks of BLOCK_M rows (kernels/triton/moe_align.py, whose docstring gives the layout: a
block holds one expert, so each program streams that expert's weight tile once for all its
rows); no host sync. Pairs with a negative expert id (experts owned elsewhere) are skipped.

Decode-sized batches (at most _PAIR_BLOCKS pairs) skip the grouping: each (token, slot) pair is
a block of its own, its expert read from topk_ids inside both GEMMs (three launches, not four).
A second GEMM that summed a token's pairs in its epilogue measured slower (one program per
token and N tile streams all k experts one after the other).
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import MAX_TICKETS, tickets
from tandem.kernels.triton.e4m3 import fast_cvt
from tandem.kernels.triton.linear import (MAX_ROWS, dot_w, pend_norm, pending_rstd, scale_back, w8_scale_args,
                                          w8_scale_kind, w_scale_ptrs, w_scales)
from tandem.kernels.triton.moe_align import _align
from tandem.kernels.triton.pdl import launch_args, wait_previous
from tandem.kernels.triton.routing import check_routing, topk_of_rows, topk_routing_triton

_PAIR_BLOCKS = 16  # at most this many pairs: no grouping, a block per pair (decode)


@triton.jit
def _held_slots(ids_ptr, token, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """(slots, held): the token's top-k slots [K_PAD] and which of them have an expert held here."""
    slot = tl.arange(0, K_PAD)
    e = tl.load(ids_ptr + token * TOP_K + slot, mask=slot < TOP_K, other=-1)
    return slot, (e >= 0) & (e < num_experts)


@triton.jit
def _valid_pairs(ids_ptr, token, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """How many of the token's top-k pairs have an expert held here."""
    _, valid = _held_slots(ids_ptr, token, num_experts, TOP_K, K_PAD)
    return tl.sum(valid.to(tl.int32), axis=0)


@triton.jit
def _sum_pairs_tile(pair_out_ptr, stride_p, ids_ptr, sum_ptr, token, rn, n_mask, N, num_experts,
                    res_ptr, g_ptr, sg_ptr, ss_ptr, strip, strips,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM_OUT: tl.constexpr):
    """sum_ptr[token, rn] = the token's pair rows of pair_out at columns rn, summed in float32
    (pairs whose expert is not held here left out). NORM_OUT: plus the residual row (res_ptr),
    with the RMSNorm after it left pending as kernels/triton/linear.py leaves it: the sum times
    the norm weight to sg_ptr, the tile's sum of squares to ss_ptr[token, strip]."""
    slot, valid = _held_slots(ids_ptr, token, num_experts, TOP_K, K_PAD)
    v = tl.load(pair_out_ptr + (token * TOP_K + slot)[:, None] * stride_p + rn[None, :],
                mask=valid[:, None] & n_mask[None, :], other=0.0, cache_modifier=".cg")
    y = tl.sum(v.to(tl.float32), axis=0).to(sum_ptr.dtype.element_ty)
    if NORM_OUT:
        r = tl.load(res_ptr + token * N + rn, mask=n_mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(y.dtype)
        g = tl.load(g_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        sg, sumsq = pend_norm(y, g, n_mask)
        tl.store(ss_ptr + token * strips + strip, sumsq)
        tl.store(sg_ptr + token * N + rn, sg, mask=n_mask)
    tl.store(sum_ptr + token * N + rn, y, mask=n_mask)


@triton.jit
def _rank_pair(logits_ptr, stride_l, pair, num_experts, rounds, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
               E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr):
    """(expert, weight) of pair (token pair // TOP_K, slot pair % TOP_K), ranked from the router
    logits [T, E] as kernels/triton/routing.py ranks them; rounds as topk_of_rows takes it (the
    slot's id is final from slot + 1 rounds on; the weight needs all of them)."""
    ex = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + (pair // TOP_K).to(tl.int64) * stride_l + ex[None, :],
                     mask=(ex < num_experts)[None, :], other=float("-inf")).to(tl.float32)
    top_w, top_id = topk_of_rows(logits, ex, ex < num_experts, TOP_K, K_PAD, E_PAD, SOFTMAX, RENORMALIZE, rounds)
    mine = tl.arange(0, K_PAD)[None, :] == pair % TOP_K
    return (tl.sum(tl.sum(tl.where(mine, top_id, 0), axis=1), axis=0),
            tl.sum(tl.sum(tl.where(mine, top_w, 0.0), axis=1), axis=0))


@triton.jit
def gated_scatter_store(out_ptr, stride_om, acc, acc_up, own_row, pair, row_mask, rn, n_mask, topk_w_ptr,
                        GATED: tl.constexpr, SCATTER_OUT: tl.constexpr):
    """The expert GEMMs' epilogue (bf16 and fp8, kernels/triton/fp8.py): acc / acc_up [BLOCK_M, BLOCK_N]
    float32 (gate and up with GATED; acc_up unused without). GATED: silu(gate) * up, rounded like the
    reference (on out-dtype values); SCATTER_OUT: the row goes to out[pair] times topk_w[pair], else
    to out[own_row]. Columns rn (n_mask), rows row_mask."""
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    if SCATTER_OUT:
        weight = tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0).to(out_ty).to(tl.float32)
        acc = acc.to(out_ty).to(tl.float32) * weight[:, None]
        out_row = pair
    else:
        out_row = own_row
    tl.store(out_ptr + out_row[:, None] * stride_om + rn[None, :], acc.to(out_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, topk_w_ptr,
    N, K, stride_am, stride_we, stride_wn, stride_om, num_n_tiles, num_experts, sum_ptr, ticket_ptr,
    logits_ptr, stride_l, ss_in_ptr, in_strips, eps, res_ptr, g_ptr, sg_ptr, ss_ptr,
    ws_ptr, stride_wsn, rows_per_scale, k_per_scale, stride_wse,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, GATED: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FUSED_SUM: tl.constexpr, K_PAD: tl.constexpr,
    ROUTE: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    EARLY_EXPERT: tl.constexpr, NORM_IN: tl.constexpr, S_PAD: tl.constexpr,
    NORM_OUT: tl.constexpr, W_SCALE: tl.constexpr, FAST_CVT: tl.constexpr, PDL: tl.constexpr,
    PRE_W: tl.constexpr = False,
):
    """out[rows] = a[rows] @ w[e].T for the BLOCK_M rows of one expert block.

    W_SCALE (fp8 experts read into this bf16 kernel, W8A16; kernels/triton/linear.py dot_w): 1 per
    channel, ws [E, N_w]; 2 block-scaled, ws [E, N_w / rows_per_scale, K / k_per_scale]; 3 the same
    with each strip (the up half's too) inside one row block: one scalar scale a K block.
    GATHER_A: a row is x[pair // TOP_K] (first GEMM) instead of the block's own row (second).
    GATED: w[e] is [2N, K] as [gate | up]; the program writes silu(a @ gate.T) * (a @ up.T).
    SCATTER_OUT: row goes to out[pair] scaled by topk_w[pair], else to the block's own row.
    PAIRS: block b is pair b alone (one row), its expert block_expert_ptr[b] (= topk_ids), and
    its own row is row b.
    FUSED_SUM (PAIRS and SCATTER_OUT, out = pair rows [T * TOP_K, N]): also sum_ptr[t] = the sum of
    token t's pair rows: the token's last pair to finish an N tile (ticket_ptr[t, tile]) sums them.
    ROUTE (PAIRS, first GEMM, every expert held here): the pair's expert and weight come from the
    router logits [T, E] (logits_ptr): each program ranks its token's experts as
    kernels/triton/routing.py does and takes its slot's; the N tile 0 program writes them to
    block_expert_ptr / topk_w_ptr for the second GEMM. (No routing launch ahead of it.) A program
    ranks only as far as its own slot, the N tile 0 program (the renormalized weight needs all k)
    to the end: the ranking delays every program's first weight load, so the short ones start
    streaming sooner.
    EARLY_EXPERT (PAIRS, second GEMM after a ROUTE one): the pair's expert is ranked from the
    router logits (two launches back, complete) before the wait, not read from the first GEMM.
    PRE_W (EARLY_EXPERT, not GATED): that expert's first weight tile and its scales are loaded
    before the wait too, their HBM latency under the first GEMM.
    NORM_IN (first GEMM): a rows are s * norm weight from a NORM_OUT GEMM (kernels/triton/linear.py)
    and ss_in_ptr [rows, in_strips] its partial sums of squares of s: the accumulators are scaled
    by the row's rsqrt(mean(s^2) + eps) before the activation, which makes the rows rms_norm(s).
    NORM_OUT (FUSED_SUM): the token's sum plus the residual, the next RMSNorm left pending
    (_sum_pairs_tile).
    """
    # N tiles vary fastest: the programs in flight share the block's rows and the expert's weights
    pid = tl.program_id(0)
    block = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    if EARLY_EXPERT:
        early_expert, _ = _rank_pair(logits_ptr, stride_l, block, num_experts, block % TOP_K + 1,
                                     TOP_K, K_PAD, E_PAD, SOFTMAX, False)
        if PRE_W:
            e0 = tl.minimum(tl.maximum(early_expert, 0), num_experts - 1).to(tl.int64)  # (a skipped pair: unused)
            k0_mask = (rk < K) | EVEN_K
            w0 = tl.load(w_ptr + e0 * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                         mask=n_mask[None, :] & k0_mask[:, None], other=0.0)
            s0 = w_scales(w_scale_ptrs(ws_ptr + e0 * stride_wse, rn, pid_n * BLOCK_N, rows_per_scale, stride_wsn,
                                       W_SCALE), 0, K, k_per_scale, n_mask, W_SCALE)
    wait_previous(PDL)
    if ROUTE:
        expert, weight = _rank_pair(logits_ptr, stride_l, block, num_experts,
                                    tl.where(pid_n == 0, TOP_K, block % TOP_K + 1),
                                    TOP_K, K_PAD, E_PAD, SOFTMAX, RENORMALIZE)
        if pid_n == 0:
            tl.store(block_expert_ptr + block, expert)
            tl.store(topk_w_ptr + block, weight)
    elif EARLY_EXPERT:
        expert = early_expert
    else:
        expert = tl.load(block_expert_ptr + block)
    if (expert < 0) | (expert >= num_experts):
        if FUSED_SUM:  # a token none of whose experts is held here still gets its (zero) row
            token = (block // TOP_K).to(tl.int64)
            if (block % TOP_K == 0) & (_valid_pairs(block_expert_ptr, token, num_experts, TOP_K, K_PAD) == 0):
                rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(sum_ptr + token * N + rn, tl.zeros([BLOCK_N], dtype=sum_ptr.dtype.element_ty),
                         mask=rn < N)
        return
    rm = tl.arange(0, BLOCK_M)
    if PAIRS:
        row_mask = rm < 1
        own_row = block.to(tl.int64) + rm
        pair = own_row
    else:
        row_mask = rm < tl.load(block_rows_ptr + block)
        own_row = block.to(tl.int64) * BLOCK_M + rm
        pair = tl.load(sorted_ptr + own_row, mask=row_mask, other=0).to(tl.int64)
    a_row = pair // TOP_K if GATHER_A else own_row
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM_IN:
        rstd = pending_rstd(ss_in_ptr, a_row, row_mask, in_strips, K, eps, S_PAD)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_row = ws_ptr + expert.to(tl.int64) * stride_wse
    ws_ptrs = w_scale_ptrs(ws_row, rn, pid_n * BLOCK_N, rows_per_scale, stride_wsn, W_SCALE)
    ws_up_ptrs = w_scale_ptrs(ws_row, rn + N, pid_n * BLOCK_N + N, rows_per_scale, stride_wsn, W_SCALE)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRE_W:
        s = s0
    else:
        s = w_scales(ws_ptrs, 0, K, k_per_scale, n_mask, W_SCALE)
    s_up = s
    if GATED:
        s_up = w_scales(ws_up_ptrs, 0, K, k_per_scale, n_mask, W_SCALE)
    k_first = 0
    if PRE_W:  # the first K tile, its weights loaded before the wait
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k0_mask[None, :], other=0.0)
        s_next = w_scales(ws_ptrs, BLOCK_K, K, k_per_scale, n_mask, W_SCALE)
        acc = dot_w(acc, a, w0, s, W_SCALE, FAST_CVT)
        s = s_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k_mask = (rk < K - k0) | EVEN_K  # folds away when K is a multiple of BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[None, :] & k_mask[:, None]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        s_next = w_scales(ws_ptrs, k0 + BLOCK_K, K, k_per_scale, n_mask, W_SCALE)  # a tile ahead (w_scales)
        acc = dot_w(acc, a, w, s, W_SCALE, FAST_CVT)
        s = s_next
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            s_up_next = w_scales(ws_up_ptrs, k0 + BLOCK_K, K, k_per_scale, n_mask, W_SCALE)
            acc_up = dot_w(acc_up, a, w_up, s_up, W_SCALE, FAST_CVT)
            s_up = s_up_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = scale_back(acc, ws_ptrs, n_mask, W_SCALE, FAST_CVT)
    if GATED:
        acc_up = scale_back(acc_up, ws_up_ptrs, n_mask, W_SCALE, FAST_CVT)
    if NORM_IN:
        acc *= rstd[:, None]
        acc_up *= rstd[:, None]
    gated_scatter_store(out_ptr, stride_om, acc, acc_up, own_row, pair, row_mask, rn, n_mask, topk_w_ptr,
                        GATED, SCATTER_OUT)
    if FUSED_SUM:
        token = (block // TOP_K).to(tl.int64)
        tl.debug_barrier()  # every thread's part of the row is written before the ticket is taken
        ticket = ticket_ptr + token * num_n_tiles + pid_n
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == _valid_pairs(
                block_expert_ptr, token, num_experts, TOP_K, K_PAD) - 1:
            _sum_pairs_tile(out_ptr, stride_om, block_expert_ptr, sum_ptr, token, rn, n_mask, N, num_experts,
                            res_ptr, g_ptr, sg_ptr, ss_ptr, pid_n, num_n_tiles, TOP_K, K_PAD, NORM_OUT)
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_topk_kernel(pair_out_ptr, ids_ptr, out_ptr, H, num_experts, res_ptr, g_ptr, sg_ptr, ss_ptr,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, NORM_OUT: tl.constexpr,
                     PDL: tl.constexpr):
    wait_previous(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _sum_pairs_tile(pair_out_ptr, H, ids_ptr, out_ptr, tl.program_id(0).to(tl.int64), cols, cols < H, H,
                    num_experts, res_ptr, g_ptr, sg_ptr, ss_ptr, tl.program_id(1), tl.num_programs(1),
                    TOP_K, K_PAD, NORM_OUT)


def _config(num_pairs: int, num_experts: int, dtype: torch.dtype, fp8_weights: bool = False) -> dict:
    """Tile shapes by rows per expert: tiny blocks and deep K tiles when memory-bound (decode).
    fp8_weights (W8A16): at a block per pair, N tiles twice as wide, so a K step streams as many
    weight bytes as the bf16 plan (W8A16_PAIRS)."""
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if num_pairs <= _PAIR_BLOCKS:
        if fp8_weights:
            return dict(W8A16_PAIRS)
        # narrow tiles, 2 warps: enough programs to keep every SM streaming an expert's rows
        # (each GEMM's fastest plan in a sweep at 1 and 2 tokens)
        cfg = dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_N2=32, BLOCK_K=128, num_warps=2, num_stages=3)
    elif rows_per_expert <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N1=128, BLOCK_N2=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if dtype.itemsize > 2:  # same shared memory per stage for 4-byte operands
        cfg.update(BLOCK_K=cfg["BLOCK_K"] // 2, num_stages=min(cfg["num_stages"], 3))
    return cfg


# The W8A16 plan at a block per pair, chosen inside the Qwen3-30B-A3B decode step (benchmarks/plan_tune.py:
# 4 warps and 3 stages in the second GEMM took the step's graph replay from 2921 to 2768 us on an H200,
# 2026-11-28, where the cold sweep of benchmarks/fp8_moe.py --w8a16 had picked 2 warps; 128-wide strips in
# the second GEMM, 2463 -> 2450 us, 2026-11-29, benchmarks/RESULTS.md).
W8A16_PAIRS = dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_N2=128, BLOCK_K=128, num_warps=4, num_stages=4, num_stages2=3)


def moe_gemm_meta(cfg: dict, gemm: int, block_k: int | None) -> dict:
    """The launch meta of one expert GEMM of an MoE plan, bf16 or fp8 (gemm 1: w13, 2: w2): its
    BLOCK_N{gemm} and the shared BLOCK_M, BLOCK_K, num_warps, num_stages unless the plan overrides them per GEMM
    (num_warps2, ...). Raises ValueError for a plan without the GEMM's N tile or with a BLOCK_K
    that does not divide the weight's K block."""
    if f"BLOCK_N{gemm}" not in cfg:
        raise ValueError(f"MoE plan {cfg} has no BLOCK_N{gemm}: it needs BLOCK_N1 (w13) and BLOCK_N2 (w2)")
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg[f"BLOCK_N{gemm}"],
                **{key: cfg.get(f"{key}{gemm}", cfg[key]) for key in ("BLOCK_K", "num_warps", "num_stages")})
    if block_k is not None and block_k % meta["BLOCK_K"]:
        raise ValueError(f"MoE plan {cfg}: BLOCK_K {meta['BLOCK_K']} must divide the weight's K block {block_k}")
    return meta


def fused_experts_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, pdl: bool = True,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [T, k]; topk_ids: [T, k] int
    (negative = skipped). Returns sum_k weight_k * expert_k(x): [T, H] in x.dtype."""
    return _fused_experts(x, w13, w2, topk_weights, topk_ids, pdl=pdl)


def routed_experts_triton(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, scoring: str = "softmax", norm_in: tuple[torch.Tensor, float] | None = None,
    norm_out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = True, scales: tuple | None = None,
    int_convert: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_routing_triton, then fused_experts_triton, every expert held here. With a block per
    pair (decode), the first expert GEMM ranks the experts itself: one launch
    fewer, the same weights and experts. norm_in = (ss, eps): x is s * norm weight and ss the
    partial sums of squares from kernels/triton/linear.py skinny_linear_add_norm_triton; the
    experts see rms_norm(s). norm_out = (residual, norm weight): returns (s, sg, ss), the output
    plus the residual with the next RMSNorm left pending (kernels/triton/linear.py).
    scales = (w13_scale, w2_scale, block): w13 / w2 are fp8 (kernels/fp8.py layouts), read into
    these bf16 kernels (W8A16; int_convert: e4m3 read by integer ops, kernels/triton/e4m3.py)."""
    num_tokens = x.shape[0]
    if not 0 < num_tokens * top_k <= _PAIR_BLOCKS:
        weights, ids = topk_routing_triton(router_logits, top_k, renormalize, scoring, pdl)
        return _fused_experts(x, w13, w2, weights, ids, norm_in=norm_in, norm_out=norm_out, pdl=pdl,
                              scales=scales, int_convert=int_convert)
    check_routing(router_logits, top_k, scoring)  # (topk_routing_triton checks on the other path)
    weights = torch.empty(num_tokens, top_k, device=x.device, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, device=x.device, dtype=torch.int32)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    return _fused_experts(x, w13, w2, weights, ids, router=(logits, renormalize, scoring == "softmax"),
                          norm_in=norm_in, norm_out=norm_out, pdl=pdl, scales=scales, int_convert=int_convert)


def _fused_experts(x, w13, w2, topk_weights, topk_ids, cfg: dict | None = None, router: tuple | None = None,
                   norm_in: tuple | None = None, norm_out: tuple | None = None, pdl: bool = True,
                   scales: tuple | None = None, int_convert: bool = True):
    """fused_experts_triton with an optional explicit tile config (benchmark sweeps, tests; FUSED_SUM=False
    forces the sum launch). router =
    (logits [T, E], renormalize, softmax): topk_weights / topk_ids are outputs, filled by the
    first GEMM (a block per pair only). norm_in / norm_out / scales: see routed_experts_triton."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return (out, out, torch.zeros(MAX_ROWS, 1, device=x.device)) if norm_out is not None else out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    w13_scale, w2_scale, block = scales if scales is not None else (None, None, None)
    if cfg is None:
        cfg = _config(num_pairs, num_experts, x.dtype, fp8_weights=scales is not None)
        if block is not None and cfg["BLOCK_K"] > block[1]:  # K tiles within the weight's K block
            cfg["BLOCK_K"] = block[1]
    block_m = cfg["BLOCK_M"]

    # the two GEMMs may be tuned apart: BLOCK_K2, num_warps2, ... override the shared keys
    meta1, meta2 = (dict(moe_gemm_meta(cfg, i, block[1] if block else None), TOP_K=top_k) for i in (1, 2))
    # dot_w's scale arguments, then the stride between experts' scales
    (ws13, kind), (ws2, _) = (w8_scale_args(s, block, out) for s in (w13_scale, w2_scale))
    ws13, ws2 = ((*ws, ws[0].stride(0) if kind else 0) for ws in (ws13, ws2))
    fast = kind > 0 and int_convert and fast_cvt(x, w13)

    pairs = cfg.get("PAIRS", num_pairs <= _PAIR_BLOCKS)
    if router is not None and not pairs:
        raise ValueError("routing in the expert GEMM needs a block per pair")
    logits, renormalize, softmax = router if router is not None else (out, False, True)
    route = dict(ROUTE=router is not None, E_PAD=triton.next_power_of_2(num_experts), SOFTMAX=softmax,
                 RENORMALIZE=renormalize)
    if pairs:
        # A block per pair (its expert read in the kernel): no grouping launch.
        num_blocks, act_rows = num_pairs, num_pairs
        sorted_pairs = block_expert = block_rows = topk_ids
    else:
        num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
        sorted_pairs, block_expert, block_rows = _align(topk_ids, num_experts, block_m, num_blocks, pdl)
        act_rows = num_blocks * block_m
    act = torch.empty(act_rows, inter, device=x.device, dtype=x.dtype)
    ss_in, eps = norm_in if norm_in is not None else (out, 0.0)
    in_strips = ss_in.shape[1] if norm_in is not None else 1
    n_tiles = triton.cdiv(inter, cfg["BLOCK_N1"])
    k_pad = triton.next_power_of_2(top_k)
    _grouped_gemm_kernel[(num_blocks * n_tiles,)](
        x, w13, act, sorted_pairs, block_expert, block_rows, topk_weights,
        inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), n_tiles, num_experts,
        out, out, logits, logits.stride(0), ss_in, in_strips, eps, out, out, out, out, *ws13, GATHER_A=True,
        SCATTER_OUT=False, GATED=True, PAIRS=pairs, EVEN_K=hidden % meta1["BLOCK_K"] == 0, FUSED_SUM=False,
        K_PAD=k_pad, EARLY_EXPERT=False, NORM_IN=norm_in is not None, S_PAD=triton.next_power_of_2(in_strips),
        NORM_OUT=False, W_SCALE=w8_scale_kind(kind, block, (meta1["BLOCK_N"], 0), (meta1["BLOCK_N"], inter)),
        FAST_CVT=fast, **route, **meta1, **launch_args(x, pdl),
    )
    pair_out = torch.empty(num_pairs, hidden, device=x.device, dtype=x.dtype)
    n_tiles = triton.cdiv(hidden, cfg["BLOCK_N2"])
    fused_sum = cfg.get("FUSED_SUM", True) and pairs and num_tokens * n_tiles <= MAX_TICKETS
    sum_block = min(1024, triton.next_power_of_2(hidden))
    if norm_out is not None:
        residual, norm_weight = norm_out
        residual = residual.contiguous()
        sg = torch.empty_like(out)
        ss = torch.empty(max(MAX_ROWS, num_tokens), n_tiles if fused_sum else triton.cdiv(hidden, sum_block),
                         device=x.device, dtype=torch.float32)
        norm_args = (residual, norm_weight, sg, ss)
    else:
        norm_args = (out, out, out, out)
    _grouped_gemm_kernel[(num_blocks * n_tiles,)](
        act, w2, pair_out, sorted_pairs, block_expert, block_rows, topk_weights,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), n_tiles, num_experts,
        out, tickets(x.device), logits, logits.stride(0), out, 1, 0.0, *norm_args, *ws2, GATHER_A=False,
        SCATTER_OUT=True, GATED=False, PAIRS=pairs, NORM_IN=False, S_PAD=1, NORM_OUT=norm_out is not None,
        W_SCALE=w8_scale_kind(kind, block, (meta2["BLOCK_N"], 0)), FAST_CVT=fast,
        EVEN_K=inter % meta2["BLOCK_K"] == 0, FUSED_SUM=fused_sum, K_PAD=k_pad,
        # PRE_W, fp8 weights (W8A16): Qwen3-30B-A3B FP8 decode b=1 on an H200, 2.597-2.615 -> 2.579 ms;
        # bf16 weights keep their tile behind the wait (3.610 -> 3.636 ms on an H100; benchmarks/RESULTS.md)
        EARLY_EXPERT=router is not None, PRE_W=router is not None and kind > 0 and cfg.get("PRE_W", True),
        **dict(route, ROUTE=False), **meta2, **launch_args(x, pdl),
    )
    if not fused_sum:
        _sum_topk(pair_out, topk_ids, out, num_experts, sum_block, norm_args, norm_out is not None, pdl)
    return (out, sg, ss) if norm_out is not None else out


def _sum_topk(pair_out: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, num_experts: int,
              block: int, norm_args: tuple, norm_out: bool, pdl: bool) -> None:
    """out[t] = sum of the token's pair rows of pair_out (pairs with a skipped expert left out);
    norm_out: plus the residual, the next norm left pending (norm_args = residual, weight, sg, ss)."""
    (num_tokens, top_k), hidden = topk_ids.shape, out.shape[1]
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
        pair_out, topk_ids, out, hidden, num_experts, *norm_args,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK=block, NORM_OUT=norm_out, num_warps=4,
        **launch_args(out, pdl),
    )

"""One token's routed FP8 experts as one persistent launch: w13 and w2 through one ring of shared-memory stages a
program (Gluon: TMA and wgmma; Hopper). KernelConfig.fp8_tma_ring_moe_fused; off until measured.

Why: on the ring form (kernels/triton/fp8_tma.py fp8_tma_ring_experts) w13 and w2 are two launches, and the
Qwen3-30B-A3B b=1 layer moves their 37.6 MB at 1.7 TB/s, 56% of the copy rate (benchmarks/RESULTS.md, forty-second
session): w2's programs get onto the SMs that w13's leave room on (79 of 132) and request 5 of their 6 tiles there,
then wait for the whole of w13 behind PDL; their sixth tile, the split-K ticket and sum follow with DRAM idle. Here
every program runs a fixed list of work items, its w13 items first, then its w2 items, all of their weight tiles in
one sequence through one ring: a stage freed by a w13 tile is refilled with the next tile of the sequence, w2's
included, so DRAM streams w13 and w2 back to back, and a w2 item waits only for its own pair's activation (a
counter the SiLU-and-mul's writer raises), not for the launch.

Work: w13 items are (strip, K share) of the top-k pairs' strips side by side (as fp8_tma_ring_experts' EXPERT_STRIPS,
SPLIT13 shares of a strip, the 2 * SPLIT13 programs of a gate strip and its up strip taking one ticket, the last
writing that 128-column group of the pair's activation quantized: fp8_tma._silu_out), w2 items (strip, pair, K
share) as its EXPERT_SHARES (the split-K sum over the pairs is the top-k sum; the strip's last program writes out,
with the pending norm's producer side: fp8_tma._finish). Program p of PROGS takes w13 items p, p + PROGS, ...; its
w2 items run the other way (PROGS - 1 - p, ...), so the programs with one w13 item fewer take the w2 items first.
A w2 item's x tiles (its pair's activation, written by other programs) are loaded once the pair's counter says all
of its groups are written, into shared memory of their own; the counter is put back to zero by the last of the
pair's w2 items to read it.

Every program ranks the router logits itself (softmax over their bf16 codes, as fp8_tma._ranked_logit; all top-k
slots at once here: _ranked_all), after its PDL wait: the logits and x's row come from the launch just ahead
(route_token_triton). Its weight scales, the whole sequence's, and x's scales are loaded together after the ranking,
into registers every thread holds whole.

Programs wait on other programs' counters, so every program must be resident at once: PROGS is at most the SMs
times the programs an SM holds (shared memory), the GPU is not shared with other work, and each program finishes
its w13 items before it waits on any counter.

Gluon has no interpreter: CPU tests compile it for sm_90; its numbers are checked against the ring form's and the
reference on a GPU (tests/kernels/test_fp8_tma_moe.py).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from tandem.kernels.triton.device import num_sms, tickets
from tandem.kernels.triton.fp8_tma import (BK, BM, BN, CTA_BARRIER, SMEM_PER_SM, TMA_LOAD, _finish, _key_logit,
                                           _pick, _silu_out, _sg_quant_args, _stamp, _w_desc, _x_desc)
from tandem.kernels.triton.pdl import launch_args
from tandem.kernels.triton.trace import trace_args

# (H, I, top_k) -> {"SPLIT": w13's K shares a strip, "SHARES": w2's K shares a pair, "PER_SM": programs an SM,
# "STAGES": ring stages}; a missing key takes fused_plan's rule
FUSED_PLANS: dict[tuple[int, int, int], dict] = {}


@gluon.jit
def _ranked_all(logits_ptr, num_experts, dtype: gl.constexpr, E_PAD: gl.constexpr, TOP_K: gl.constexpr,
                K_PAD: gl.constexpr, RENORMALIZE: gl.constexpr, kl: gl.constexpr, num_warps: gl.constexpr):
    """All top-k slots of one token's router logits [num_experts] float32 (values of the 16-bit dtype) at softmax
    scoring: (ids [K_PAD] int32, weights [K_PAD] float32) in layout kl, slot order. The keys, rounds and weights
    of fp8_tma._ranked_logit with NEED_W, bit for bit (the same exps, the same order of the renormalizing sum),
    every slot kept instead of one."""
    lay: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
    ex = gl.arange(0, E_PAD, layout=lay)
    ok = ex < num_experts
    x = gl.load(logits_ptr + ex, mask=ok, other=float("-inf"))
    code = x.to(dtype).to(gl.int16, bitcast=True).to(gl.int32)
    keys = gl.where(ok, (gl.where(code < 0, -32768 - code, code) << 16) | (E_PAD - 1 - ex), -2147483647)
    kk = gl.arange(0, K_PAD, layout=kl)
    best = gl.max(keys, axis=0)
    mx = _key_logit(best, dtype)
    s = gl.sum(gl.exp(x - mx), axis=0)
    first = gl.exp(mx - mx) / s
    total = first
    ids = gl.where(kk == 0, (E_PAD - 1 - (best & 0xFFFF)), gl.zeros([K_PAD], gl.int32, kl))
    ws = gl.where(kk == 0, first, gl.zeros([K_PAD], gl.float32, kl))
    for i in gl.static_range(1, TOP_K):
        keys = gl.where(keys == best, -2147483647, keys)
        best = gl.max(keys, axis=0)
        w = gl.exp(_key_logit(best, dtype) - mx) / s
        total += w
        ids = gl.where(kk == i, (E_PAD - 1 - (best & 0xFFFF)), ids)
        ws = gl.where(kk == i, w, ws)
    if RENORMALIZE:
        ws = ws / total
    return ids, ws


@gluon.jit
def _tile(t, p, n13t, ids, kl: gl.constexpr, PROGS: gl.constexpr, SPLIT13: gl.constexpr, T13: gl.constexpr,
          STRIPS13: gl.constexpr, S2: gl.constexpr, SHARES: gl.constexpr, T2: gl.constexpr):
    """Tile t of program p's sequence (n13t w13 tiles, then its w2 tiles): (is13, its item's output strip, K share
    and pair, its weight row block, its K tile in the weight, its index in the item)."""
    is13 = t < n13t
    if is13:
        i = p + (t // T13) * PROGS
        kt = t % T13
        strip = i // SPLIT13
        share = i % SPLIT13
        pair = strip // STRIPS13
        w_row = _pick(ids, pair, kl) * STRIPS13 + strip % STRIPS13
        kk = share * T13 + kt
    else:
        t2 = t - n13t
        q = (PROGS - 1 - p) + (t2 // T2) * PROGS
        kt = t2 % T2
        strip = q % S2
        share = q // S2  # pair * SHARES + the pair's K share: w2's split-K index
        pair = share // SHARES
        w_row = _pick(ids, pair, kl) * S2 + strip
        kk = share % SHARES * T2 + kt
    return is13, strip, share, pair, w_row, kk, kt


@gluon.jit
def _issue(t, p, n13t, ids, kl: gl.constexpr, w13_desc, w2_desc, x_desc, bar, w_dst, x_dst, PROGS: gl.constexpr,
           SPLIT13: gl.constexpr, T13: gl.constexpr, STRIPS13: gl.constexpr, S2: gl.constexpr, SHARES: gl.constexpr,
           T2: gl.constexpr):
    """Request tile t's weight (and, for w13, x's K tile) into a stage, on bar."""
    is13, _, _, _, w_row, kk, _ = _tile(t, p, n13t, ids, kl, PROGS, SPLIT13, T13, STRIPS13, S2, SHARES, T2)
    BN_: gl.constexpr = w13_desc.block_type.shape[0]
    BK_: gl.constexpr = w13_desc.block_type.shape[1]
    if is13:
        mbarrier.expect(bar, w13_desc.block_type.nbytes + x_desc.block_type.nbytes)
        TMA_LOAD(w13_desc, [w_row * BN_, kk * BK_], bar, w_dst)
        TMA_LOAD(x_desc, [0, kk * BK_], bar, x_dst)
    else:
        mbarrier.expect(bar, w2_desc.block_type.nbytes)
        TMA_LOAD(w2_desc, [w_row * BN_, kk * BK_], bar, w_dst)


@gluon.jit
def _fp8_tma_moe_kernel(w13_desc, w2_desc, x_desc, xs_ptr, s13_ptr, s2_ptr, logits_ptr, num_experts,
                        part13_ptr, aq_ptr, as_ptr, part2_ptr, ticket_ptr, out_ptr, res_ptr, g_ptr, sg_ptr, ss_ptr,
                        ss_in_ptr, in_strips, eps, stride_s13, stride_s2, stride_rm, stride_gm,
                        fp8_max, sq_ptr, sqs_ptr, trace_ptr,
                        H: gl.constexpr, I: gl.constexpr, PROGS: gl.constexpr, SPLIT13: gl.constexpr,
                        SHARES: gl.constexpr, STAGES: gl.constexpr, TV_PAD: gl.constexpr, E_PAD: gl.constexpr,
                        TOP_K: gl.constexpr, K_PAD: gl.constexpr, RENORMALIZE: gl.constexpr,
                        NORM_IN: gl.constexpr, S_PAD: gl.constexpr, NORM_OUT: gl.constexpr,
                        QUANT_SG: gl.constexpr, PDL: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """The fused experts (module docstring) for x's one row: w13 [E * 2I, H] and w2 [E * H, I] e4m3 by TMA, their
    scales s13 [E * 2I / 128, H / 128] and s2 [E * H / 128, I / 128]; x's row xq by TMA (x_desc) and its scales xs
    [1, H / 128] (NORM_IN: a pending norm's sg, its 1/rms from ss_in [16, in_strips] applied to w13's sums);
    part13 [SPLIT13, BM, top_k * 2I] and part2 [top_k * SHARES, BM, H] float32 partials; aq [top_k, I] e4m3 and
    as [top_k, I / 128] the pairs' activations; tickets: w13's groups at 0, w2's strips after them, then the
    pairs' counters of written groups and of their readers. out [1, H] (NORM_OUT: + the residual, sg, ss, and
    QUANT_SG sg quantized, as fp8_tma._write_out)."""
    BN_: gl.constexpr = w13_desc.block_type.shape[0]
    BK_: gl.constexpr = w13_desc.block_type.shape[1]
    BM_: gl.constexpr = x_desc.block_type.shape[0]
    HALF: gl.constexpr = I // BN_  # 128-column groups of a pair's activation
    STRIPS13: gl.constexpr = 2 * HALF  # w13 strips a pair (its gate's, then its up's)
    N13: gl.constexpr = TOP_K * STRIPS13 * BN_
    T13: gl.constexpr = H // BK_ // SPLIT13
    ITEMS13: gl.constexpr = TOP_K * STRIPS13 * SPLIT13
    S2: gl.constexpr = H // BN_
    T2: gl.constexpr = I // BK_ // SHARES
    ITEMS2: gl.constexpr = S2 * TOP_K * SHARES
    T2_PAD: gl.constexpr = triton.next_power_of_2(T2)
    W2_TICKETS: gl.constexpr = TOP_K * HALF
    DONE: gl.constexpr = W2_TICKETS + S2
    READERS: gl.constexpr = DONE + TOP_K
    p = gl.program_id(0)
    if TRACE:
        _stamp(trace_ptr, 0)
    c13 = (ITEMS13 - p + PROGS - 1) // PROGS
    c2 = (ITEMS2 - (PROGS - 1 - p) + PROGS - 1) // PROGS
    n13t = c13 * T13
    n_t = n13t + c2 * T2

    w_smem = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, BN_, BK_], w13_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM_, BK_], x_desc.layout)
    x2_smem = gl.allocate_shared_memory(x_desc.dtype, [T2, BM_, BK_], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    if PDL:  # the logits and x's row come from the launch just ahead
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TRACE:
        _stamp(trace_ptr, 1)
    kl: gl.constexpr = gl.BlockedLayout([K_PAD], [32], [num_warps], [0])  # every thread holds the vector whole
    ids, rw = _ranked_all(logits_ptr, num_experts, out_ptr.dtype.element_ty, E_PAD, TOP_K, K_PAD, RENORMALIZE, kl,
                          num_warps)
    for s in gl.static_range(STAGES):
        if s < n_t:
            _issue(s, p, n13t, ids, kl, w13_desc, w2_desc, x_desc, bars.index(s), w_smem.index(s), x_smem.index(s),
                   PROGS, SPLIT13, T13, STRIPS13, S2, SHARES, T2)
    if TRACE:
        _stamp(trace_ptr, 5)

    # the sequence's weight scales and (w13) x's, a tile each, every thread holding them whole
    vec: gl.constexpr = gl.BlockedLayout([TV_PAD], [32], [num_warps], [0])
    tv = gl.arange(0, TV_PAD, layout=vec)
    v13 = tv < n13t
    v2 = (tv >= n13t) & (tv < n_t)
    t2v = tv - n13t
    i13 = p + (tv // T13) * PROGS
    q2 = (PROGS - 1 - p) + (t2v // T2) * PROGS
    pair13 = i13 // SPLIT13 // STRIPS13
    pair2 = q2 // S2 // SHARES
    e13 = gl.zeros([TV_PAD], gl.int32, vec)
    e2 = gl.zeros([TV_PAD], gl.int32, vec)
    for k in gl.static_range(TOP_K):
        e = _pick(ids, k, kl)
        e13 = gl.where(pair13 == k, e, e13)
        e2 = gl.where(pair2 == k, e, e2)
    kk13 = i13 % SPLIT13 * T13 + tv % T13
    row13 = e13 * STRIPS13 + i13 // SPLIT13 % STRIPS13
    kk2 = q2 // S2 % SHARES * T2 + t2v % T2
    row2 = e2 * S2 + q2 % S2
    wsv = gl.load(s13_ptr + row13 * stride_s13 + kk13, mask=v13, other=0.0) + gl.load(
        s2_ptr + row2 * stride_s2 + kk2, mask=v2, other=0.0)
    xsv = gl.load(xs_ptr + kk13, mask=v13, other=0.0)
    rstd = 1.0
    if NORM_IN:
        sl: gl.constexpr = gl.BlockedLayout([S_PAD], [32], [num_warps], [0])
        sp = gl.arange(0, S_PAD, layout=sl)
        rstd = gl.rsqrt(gl.sum(gl.load(ss_in_ptr + sp, mask=sp < in_strips, other=0.0), axis=0) / H + eps)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BM_, 256 // w13_desc.dtype.primitive_bitwidth])
    rm = gl.arange(0, BM_, layout=gl.SliceLayout(0, mma))
    rb = gl.arange(0, BN_, layout=gl.SliceLayout(1, mma))
    xl: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])  # an x tile [BM, BK] of e4m3
    xr = gl.arange(0, BM_, layout=gl.SliceLayout(1, xl))
    xc = gl.arange(0, BK_, layout=gl.SliceLayout(0, xl))
    kv = gl.arange(0, T2_PAD, layout=vec)
    asv = gl.zeros([T2_PAD], gl.float32, vec)
    r = gl.zeros([BN_, BM_], gl.float32, mma)
    g = gl.zeros([BN_], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([BN_, BM_], gl.float32, mma)
    for t in range(n_t):
        st = t % STAGES
        is13, strip, share, pair, w_row, kk, kt = _tile(t, p, n13t, ids, kl, PROGS, SPLIT13, T13, STRIPS13, S2,
                                                        SHARES, T2)
        if not is13:
            if kt == 0:  # a w2 item's first tile: its pair's activation, once every group of it is written
                rn = strip * BN_ + rb
                mask = (rm < 1)[None, :] & (rn < H)[:, None]
                if NORM_OUT:
                    r = gl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0).to(gl.float32)
                    g = gl.load(g_ptr + rn).to(gl.float32)
                done = gl.atomic_add(ticket_ptr + DONE + pair, 0, sem="acquire", scope="gpu")
                while done < HALF:
                    done = gl.atomic_add(ticket_ptr + DONE + pair, 0, sem="acquire", scope="gpu")
                CTA_BARRIER()  # (the wgmmas of the item before have read x2_smem)
                if TRACE:
                    _stamp(trace_ptr, 6)
                a0 = aq_ptr + pair * I + (share % SHARES) * T2 * BK_
                for j in gl.static_range(T2):
                    xt = gl.load(a0 + j * BK_ + xr[:, None] * 0 + xc[None, :], mask=(xr == 0)[:, None], other=0.0,
                                 cache_modifier=".cg")
                    x2_smem.index(j).store(xt)
                asv = gl.load(as_ptr + pair * HALF + (share % SHARES) * T2 + kv, mask=kv < T2, other=0.0,
                              cache_modifier=".cg") * _pick(rw, pair, kl)
                fence_async_shared()
                CTA_BARRIER()  # the x tiles are in shared memory before the warpgroup reads them
                if gl.atomic_add(ticket_ptr + READERS + pair, 1, sem="acq_rel", scope="gpu") == S2 * SHARES - 1:
                    gl.atomic_xchg(ticket_ptr + DONE + pair, 0, sem="relaxed", scope="gpu")
                    gl.atomic_xchg(ticket_ptr + READERS + pair, 0, sem="relaxed", scope="gpu")
        mbarrier.wait(bars.index(st), (t // STAGES) & 1)
        if TRACE:
            if t == 0:
                _stamp(trace_ptr, 2)
        zero = gl.zeros([BN_, BM_], gl.float32, mma)
        if is13:
            d = warpgroup_mma(w_smem.index(st), x_smem.index(st).permute((1, 0)), zero, use_acc=False)
            acc += d * (_pick(xsv, t, vec) * _pick(wsv, t, vec))
        else:
            d = warpgroup_mma(w_smem.index(st), x2_smem.index(kt).permute((1, 0)), zero, use_acc=False)
            acc += d * (_pick(asv, kt, vec) * _pick(wsv, t, vec))
        if t + STAGES < n_t:  # the wgmma above is synchronous: stage st is free again
            _issue(t + STAGES, p, n13t, ids, kl, w13_desc, w2_desc, x_desc, bars.index(st), w_smem.index(st),
                   x_smem.index(st), PROGS, SPLIT13, T13, STRIPS13, S2, SHARES, T2)
        if is13:
            if kt == T13 - 1:
                rn = strip * BN_ + rb
                mask = (rm < 1)[None, :] & (rn < N13)[:, None]
                _silu_out(acc * rstd, part13_ptr, ticket_ptr, aq_ptr, as_ptr, out_ptr, fp8_max, rm, rn, mask,
                          strip, share, 1, N13, STRIPS13, SPLIT13, ticket_ptr + DONE, True)
                acc = gl.zeros([BN_, BM_], gl.float32, mma)
        else:
            if kt == T2 - 1:
                rn = strip * BN_ + rb
                mask = (rm < 1)[None, :] & (rn < H)[:, None]
                _finish(acc, out_ptr, part2_ptr, ticket_ptr + W2_TICKETS, sg_ptr, ss_ptr, r, g, rm, rn, mask, strip,
                        share, H, 0, stride_gm, TOP_K * SHARES, NORM_OUT, sq_ptr, sqs_ptr, fp8_max, QUANT_SG, None,
                        None, 0, False, 32, num_warps, S2)
                acc = gl.zeros([BN_, BM_], gl.float32, mma)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if TRACE:
        _stamp(trace_ptr, 3)


def fused_plan(h: int, inter: int, top_k: int, sms: int) -> dict:
    """The launch's plan for experts of hidden h and intermediate inter at top_k: FUSED_PLANS's keys over the rule
    (w13 at 4 K shares a strip, w2 at one a pair, a program an SM, as many stages as shared memory leaves, at most
    the longest program's tiles), with PROGS (the programs) and TILES (the longest program's tiles)."""
    plan = {"SPLIT": 4, "SHARES": 1, "PER_SM": 1, **FUSED_PLANS.get((h, inter, top_k), {})}
    while (h // BK) % plan["SPLIT"]:
        plan["SPLIT"] //= 2
    if (inter // BK) % plan["SHARES"]:
        plan["SHARES"] = 1
    progs = sms * plan["PER_SM"]
    items13, t13 = top_k * 2 * inter // BN * plan["SPLIT"], h // BK // plan["SPLIT"]
    items2, t2 = h // BN * top_k * plan["SHARES"], inter // BK // plan["SHARES"]
    tiles = _longest(items13, t13, items2, t2, progs)
    stage = BN * BK + BM * BK
    room = SMEM_PER_SM // plan["PER_SM"] - t2 * BM * BK - 2048
    plan.setdefault("STAGES", max(1, min(tiles, room // stage)))
    return {**plan, "PROGS": progs, "TILES": tiles}


@functools.cache
def _longest(items13: int, t13: int, items2: int, t2: int, progs: int) -> int:
    """The most tiles a program runs: program p takes w13 items p, p + progs, ... and w2 items progs - 1 - p, ...
    (asked for every launch and supports check: cached)."""
    return max(len(range(p, items13, progs)) * t13 + len(range(progs - 1 - p, items2, progs)) * t2
               for p in range(progs))


def fused_supports(h: int, inter: int, top_k: int, num_experts: int) -> bool:
    """Shapes the launch takes: whole 128-blocks, up to 64 experts' top 8... (E_PAD 32-256), and a sequence of
    tiles whose scales fit the registers' vectors (TILES <= 64)."""
    return (h % BN == 0 and inter % BN == 0 and 1 <= top_k <= 16 and num_experts <= 256
            and fused_plan(h, inter, top_k, 132)["TILES"] <= 64)


def fp8_tma_fused_experts(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                          w2: torch.Tensor, w2_scale: torch.Tensor, logits: torch.Tensor, top_k: int,
                          renormalize: bool, dtype: torch.dtype, norm_in: tuple[torch.Tensor, float] | None = None,
                          residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                          pdl: bool = True, sg_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
                          trace: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_tma_ring_experts (kernels/triton/fp8_tma.py) with ranked logits [E] float32 at softmax scoring, as one
    launch (module docstring); the same arguments and outputs."""
    e, two_i, h = w13.shape
    inter = two_i // 2
    dev = xq.device
    plan = fused_plan(h, inter, top_k, num_sms(dev))
    split, shares, progs, stages = plan["SPLIT"], plan["SHARES"], plan["PROGS"], plan["STAGES"]
    n13 = top_k * two_i
    out = torch.empty(1, h, device=dev, dtype=dtype)
    norm = residual is not None
    sg = torch.empty_like(out) if norm else out
    ss = torch.empty(BM, h // BN, device=dev, dtype=torch.float32) if norm else out
    if norm:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    res, g = (residual, norm_weight) if norm else (out, out)
    part13 = torch.empty(split, BM, n13, device=dev, dtype=torch.float32)
    part2 = torch.empty(top_k * shares, BM, h, device=dev, dtype=torch.float32)
    aq = torch.empty(top_k, inter, device=dev, dtype=xq.dtype)
    a_s = torch.empty(top_k, inter // BK, device=dev, dtype=torch.float32)
    ss_in, eps = norm_in if norm_in is not None else (out, 0.0)
    s13 = w13_scale.reshape(e * two_i // BN, -1)
    s2 = w2_scale.reshape(e * h // BN, -1)
    quant = _sg_quant_args(sg_quant, norm)
    _fp8_tma_moe_kernel[(progs,)](
        _w_desc(w13.view(e * two_i, h)), _w_desc(w2.view(e * h, inter)), _x_desc(xq), xs, s13, s2,
        logits.reshape(-1), e, part13, aq, a_s, part2, tickets(dev), out, res, g, sg, ss, ss_in,
        ss_in.shape[1] if norm_in is not None else 1, eps, s13.stride(0), s2.stride(0), res.stride(0), sg.stride(0),
        float(torch.finfo(torch.float8_e4m3fn).max), quant.get("sq_ptr", out), quant.get("sqs_ptr", out),
        H=h, I=inter, PROGS=progs, SPLIT13=split, SHARES=shares, STAGES=stages,
        TV_PAD=triton.next_power_of_2(plan["TILES"]), E_PAD=max(32, triton.next_power_of_2(e)), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, NORM_IN=norm_in is not None,
        S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in is not None else 1, NORM_OUT=norm,
        QUANT_SG=quant.get("QUANT_SG", False), num_warps=4,
        **{"trace_ptr": out, "TRACE": False, **trace_args(trace, "moe", progs, dev)}, **launch_args(xq, pdl))
    return out, sg, ss

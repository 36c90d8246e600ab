"""The FP8 decode GEMM with all of its weight in shared memory before the PDL wait (Gluon: TMA and wgmma; Hopper).

Why: at decode the o projection follows the attention and its split merge, during which HBM is all but idle (a
few MB of K/V), and then streams its weight (16.8 MB on Llama-3-8B) with nothing else running. Here each program
requests every weight tile of its share by TMA (one descriptor and a coordinate a tile, into shared memory, no
registers held) before its PDL wait, so the weight can stream in while the kernels ahead still run; with
KernelConfig.fp8_tma_early the merge lets this launch in before its own wait, i.e. while the attention runs.
The Triton decode GEMM (kernels/triton/fp8_skinny.py) holds the tiles it loads early in registers, up to 4.
kernels.fp8 sends the o projection here where its weight is 12 MiB or more (_tma_gemm, with the figures): on an
H200 the Llama-3-8B b=1 step went from 2.707 to 2.609 ms, its o projection from 8.9 to 5.5 us behind the merge.

Kernel: out.T = w @ x.T for a strip of BN = 128 weight rows (the wgmma's M side) over TILES K tiles of 128 (a
split of K; SPLIT programs a strip). Block-scaled weights, (128, 128) blocks. x: [M <= 16, K] bf16/fp16, read
after the wait, quantized here per row and K tile as kernels.fp8.quantize_rows does (each tile's fp8 rows go to
shared memory for the wgmma). SPLIT > 1: float32 partials, a ticket, the strip's last program sums them
(kernels/triton/device.py). NORM_OUT: the pending RMSNorm's producer side, as the Triton decode GEMM's.

The ring form (_fp8_tma_ring_kernel, fp8_tma_ring_linear): x quantized ahead by the kernel producing it (kernels.fp8
QuantRows: the SiLU-and-mul ahead of down_proj; the quantization after a pending norm ahead of gate_up), any number
of K tiles a program through STAGES stages of a weight tile and its x tile; the first stages' weight requested
before the wait, and with KernelConfig.fp8_tma_ring_early the producer lets this launch in before its own wait. At
1 row (RING_MAX_ROWS) on an H200 the Llama-3-8B step went from 2.667 to 2.572 ms (benchmarks/RESULTS.md).

Gluon (`triton.experimental.gluon`) has no interpreter: CPU tests compile it for sm_90; its numbers are checked
against kernels.fp8's reference on a GPU.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tandem.kernels.linear import SplitPartials
from tandem.kernels.triton.device import MAX_TICKETS, num_sms, tickets
from tandem.kernels.triton.linear import MAX_ROWS
from tandem.kernels.triton.pdl import launch_args
from tandem.kernels.triton.trace import trace_args

BN, BK, BM = 128, 128, MAX_ROWS
MAX_TILES = 8  # 8 x (16 KB of weight + 6 KB of x) of shared memory a program
TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton 3.9 / 3.6
CTA_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6


@gluon.jit
def _pick(v, i, layout: gl.constexpr):
    """Element i (a constant or a run-time index) of a small vector v, int or float, every thread holds whole."""
    return gl.sum(gl.where(gl.arange(0, v.shape[0], layout=layout) == i, v, gl.zeros_like(v)), axis=0)


@gluon.jit
def _stamp(trace_ptr, slot: gl.constexpr):
    """TRACE: the GPU's nanosecond clock (%globaltimer) into slot `slot` of this program's row of 8 int64
    (fp8_tma_linear's trace: [programs, 8]); slot 4 gets the SM's id (%smid) with the first stamp, which clears
    the row's other columns. The Gluon twin of kernels/triton/trace.py's stamp."""
    row = trace_ptr + (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * 8
    if slot == 0:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(row + 4, sm.to(gl.int64))
        for col in gl.static_range(1, 8):
            if col != 4:
                gl.store(row + col, 0)
    gl.store(row + slot, gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                                   is_pure=False, pack=1))


@gluon.jit
def _fp8_tma_kernel(w_desc, x_ptr, ws_ptr, out_ptr, part_ptr, ticket_ptr, res_ptr, g_ptr, sg_ptr, ss_ptr,
                    M, N, stride_xm, stride_ws, stride_om, stride_rm, stride_gm, fp8_max,
                    TILES: gl.constexpr, SPLIT: gl.constexpr, NORM_OUT: gl.constexpr, PDL: gl.constexpr,
                    num_warps: gl.constexpr, BM_: gl.constexpr = 16, pacc_ptr=None, pml_ptr=None, seq_lens_ptr=None,
                    MERGE: gl.constexpr = 0, KV_BLOCK: gl.constexpr = 0, sq_ptr=None, sqs_ptr=None,
                    QUANT_SG: gl.constexpr = False, trace_ptr=None, TRACE: gl.constexpr = False,
                    router_ptr=None, plog_ptr=None, num_experts=0, ROUTER: gl.constexpr = False,
                    E_PAD: gl.constexpr = 128):
    # TRACE (benchmarks.program_trace): each program stamps its start, the release of its PDL wait, when it found
    # all of its weight landed (waited for apart from the dots, after x is staged) and its end.
    # ROUTER (with NORM_OUT, one token): the strip's finisher also writes the token's partial router logits over
    # the strip's columns of sg (_router_partial); every program requests its share of the strip's router weight
    # into L2 before the wait (_router_prefetch)
    BN_: gl.constexpr = w_desc.block_type.shape[0]
    BK_: gl.constexpr = w_desc.block_type.shape[1]
    KP: gl.constexpr = TILES * BK_
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BN_
    kb0 = pid_k * TILES

    if TRACE:
        _stamp(trace_ptr, 0)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [TILES, BN_, BK_], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [TILES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(TILES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(TILES):  # the weight depends on no kernel ahead: all of it requested before the wait
        mbarrier.expect(bars.index(i), w_desc.block_type.nbytes)
        TMA_LOAD(w_desc, [n0, (kb0 + i) * BK_], bars.index(i), w_smem.index(i))
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BM_, 256 // w_desc.dtype.primitive_bitwidth])
    rm = gl.arange(0, BM_, layout=gl.SliceLayout(0, mma))
    rn = n0 + gl.arange(0, BN_, layout=gl.SliceLayout(1, mma))
    mask = (rm < M)[None, :] & (rn < N)[:, None]
    vec: gl.constexpr = gl.BlockedLayout([TILES], [32], [num_warps], [0])  # every thread holds the whole vector
    ws = gl.load(ws_ptr + pid_n * stride_ws + kb0 + gl.arange(0, TILES, layout=vec))  # the strip's scales
    g = gl.zeros([BN_], gl.float32, gl.SliceLayout(1, mma))
    if NORM_OUT:
        g = gl.load(g_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
    ctx = 0
    if MERGE > 0:
        ctx = gl.load(seq_lens_ptr)  # (step metadata)
    if ROUTER:
        _router_prefetch(router_ptr, n0, pid_k, N, num_experts, SPLIT, BN_, num_warps)
    if PDL:  # (kernels/triton/pdl.py's wait_previous)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TRACE:
        _stamp(trace_ptr, 1)

    # after the wait, every load at once: x (all of the program's K share) and the epilogue's residual
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    r = gl.zeros([BN_, BM_], gl.float32, mma)
    if NORM_OUT:
        r = gl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0).to(gl.float32)
    x8_smem = gl.allocate_shared_memory(w_desc.dtype, [TILES, BM_, BK_],
                                        gl.NVMMASharedLayout.get_default_for([BM_, BK_], w_desc.dtype))
    xs_smem = gl.allocate_shared_memory(gl.float32, [TILES * BM_], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if MERGE == 0:
        # x staged in shared memory, each K tile's rows quantized (fp8 rows for the wgmma, their scales beside),
        # one barrier for all tiles
        xr = gl.arange(0, BM_, layout=gl.SliceLayout(1, xl))
        xc = gl.arange(0, KP, layout=gl.SliceLayout(0, xl))
        xall = gl.load(x_ptr + xr[:, None] * stride_xm + kb0 * BK_ + xc[None, :], mask=(xr < M)[:, None], other=0.0)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        xb_smem = gl.allocate_shared_memory(xall.dtype, [BM_, KP], plain, xall)
        CTA_BARRIER()
    for i in gl.static_range(TILES):
        if MERGE > 0:  # K tile i is head kb0 + i of the one token: merged here from the attention's splits
            xt = _merged_head(pacc_ptr, pml_ptr, kb0 + i, ctx, out_ptr.dtype.element_ty, MERGE, KV_BLOCK, BM_, BK_,
                              xl, num_warps)
        else:
            xt = xb_smem.slice(i * BK_, BK_, dim=1).load(xl).to(gl.float32)
        s = gl.maximum(gl.max(gl.abs(xt), axis=1) / fp8_max, 1e-12)
        x8_smem.index(i).store(gl.minimum(gl.maximum(xt / s[:, None], -fp8_max), fp8_max).to(w_desc.dtype))
        xs_smem.slice(i * BM_, BM_).store(s)
    fence_async_shared()
    CTA_BARRIER()  # every thread's rows are in shared memory before the warpgroup reads them

    if TRACE:
        for i in gl.static_range(TILES):
            mbarrier.wait(bars.index(i), 0)
        _stamp(trace_ptr, 2)
    acc = gl.zeros([BN_, BM_], gl.float32, mma)
    for i in gl.static_range(TILES):
        mbarrier.wait(bars.index(i), 0)
        d = warpgroup_mma(w_smem.index(i), x8_smem.index(i).permute((1, 0)), gl.zeros([BN_, BM_], gl.float32, mma),
                          use_acc=False)
        acc += d * (xs_smem.slice(i * BM_, BM_).load(gl.SliceLayout(0, mma)) * _pick(ws, i, vec))[None, :]
    for i in gl.static_range(TILES):
        mbarrier.invalidate(bars.index(i))

    _finish(acc, out_ptr, part_ptr, ticket_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, pid_k, N, stride_om,
            stride_gm, SPLIT, NORM_OUT, sq_ptr, sqs_ptr, fp8_max, QUANT_SG, router_ptr, plog_ptr, num_experts,
            ROUTER, E_PAD, num_warps)
    if TRACE:
        _stamp(trace_ptr, 3)


@gluon.jit
def _merged_head(pacc_ptr, pml_ptr, h, ctx, dtype: gl.constexpr, S: gl.constexpr, KV_BLOCK: gl.constexpr,
                 BM_: gl.constexpr, BK_: gl.constexpr, xl: gl.constexpr, num_warps: gl.constexpr):
    """Head h [BK_] of one decode token's attention output, merged from its S split-K partials (pacc [Hq, S, BK_],
    pml [Hq, S, 2] float32) as kernels/triton/attention.py's _merge_splits_kernel merges them (the splits with keys:
    those below a context of ctx keys cut in chunks of KV_BLOCK-key tiles) and rounded to dtype as it writes them;
    returned as row 0 of a [BM_, BK_] float32 tile in layout xl, the other rows 0."""
    pl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    sp = gl.arange(0, S, layout=gl.SliceLayout(1, pl))
    d = gl.arange(0, BK_, layout=gl.SliceLayout(0, pl))
    chunk = ((ctx + S - 1) // S + KV_BLOCK - 1) // KV_BLOCK * KV_BLOCK
    live = sp * chunk < ctx
    part = h * S + sp
    m = gl.load(pml_ptr + part * 2, mask=live, other=float("-inf"))
    lsum = gl.load(pml_ptr + part * 2 + 1, mask=live, other=0.0)
    a = gl.load(pacc_ptr + part[:, None] * BK_ + d[None, :], mask=live[:, None], other=0.0)
    w = gl.where(m == float("-inf"), 0.0, gl.exp2(m - gl.max(m, axis=0)))
    den = gl.sum(w * lsum, axis=0)
    row = (gl.sum(a * w[:, None], axis=0) / gl.where(den == 0.0, 1.0, den)).to(dtype).to(gl.float32)
    row = gl.convert_layout(row, gl.SliceLayout(0, xl))
    xr = gl.arange(0, BM_, layout=gl.SliceLayout(1, xl))
    return gl.where((xr == 0)[:, None], row[None, :], 0.0)


@gluon.jit
def _finish(acc, out_ptr, part_ptr, ticket_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, pid_k, N, stride_om,
            stride_gm, SPLIT: gl.constexpr, NORM_OUT: gl.constexpr, sq_ptr, sqs_ptr, fp8_max, QUANT_SG: gl.constexpr,
            router_ptr, plog_ptr, num_experts, ROUTER: gl.constexpr, E_PAD: gl.constexpr, num_warps: gl.constexpr,
            STRIPS_OUT: gl.constexpr = 0):
    """A program's acc [BN, BM] (out.T over its K share) -> out: SPLIT > 1, float32 partials and a ticket, the
    strip's last program sums them (kernels/triton/device.py); then _write_out (STRIPS_OUT as it takes it), and with
    ROUTER _router_partial."""
    BM_: gl.constexpr = acc.shape[1]
    if SPLIT > 1:
        gl.store(part_ptr + (pid_k * BM_ + rm[None, :]) * N + rn[:, None], acc, mask=mask)
        CTA_BARRIER()  # every thread's partial is written before the ticket is taken
        if gl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            if ROUTER:  # requested with the partials below, not after sg's stores (which the loads would follow)
                wr = _router_load(router_ptr, pid_n, N, num_experts, E_PAD, acc.shape[0], num_warps)
            total = gl.zeros_like(acc)
            for sp in gl.static_range(SPLIT):
                total += gl.load(part_ptr + (sp * BM_ + rm[None, :]) * N + rn[:, None], mask=mask, other=0.0,
                                 cache_modifier=".cg")
            sgv = _write_out(total, out_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, stride_om, stride_gm,
                             NORM_OUT, sq_ptr, sqs_ptr, fp8_max, QUANT_SG, STRIPS_OUT)
            if ROUTER:
                _router_partial(sgv, rm, wr, plog_ptr, pid_n, num_experts)
            gl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if ROUTER:
            wr = _router_load(router_ptr, pid_n, N, num_experts, E_PAD, acc.shape[0], num_warps)
        sgv = _write_out(acc, out_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, stride_om, stride_gm, NORM_OUT,
                         sq_ptr, sqs_ptr, fp8_max, QUANT_SG, STRIPS_OUT)
        if ROUTER:
            _router_partial(sgv, rm, wr, plog_ptr, pid_n, num_experts)


@gluon.jit
def _router_prefetch(router_ptr, n0, pid_k, N, num_experts, SPLIT: gl.constexpr, BN_: gl.constexpr,
                     num_warps: gl.constexpr):
    """ROUTER: the strip's columns n0.. of the router weight [E, N] (bf16/fp16: BN_ * 2 bytes a row, two 128-byte
    lines at BN_ 128) requested into L2 (prefetch.global.L2), each of the strip's SPLIT programs every SPLIT-th
    line from its pid_k; nothing waits for them."""
    LINE: gl.constexpr = 128 // 2  # elements a line
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    PER: gl.constexpr = BN_ // LINE  # lines a router row's strip
    i = gl.arange(0, 32 * num_warps, layout=lay)
    line = gl.minimum(pid_k + i * SPLIT, num_experts * PER - 1)
    ptrs = router_ptr + (line // PER) * N + n0 + line % PER * LINE
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _router_load(router_ptr, pid_n, N, num_experts, E_PAD: gl.constexpr, BN_: gl.constexpr, num_warps: gl.constexpr):
    """ROUTER: the strip's BN_ columns of the router weight [E, N], every expert's at once ([E_PAD, BN_], rows past
    E zeros), for _router_partial."""
    wl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    e = gl.arange(0, E_PAD, layout=gl.SliceLayout(1, wl))
    c = pid_n * BN_ + gl.arange(0, BN_, layout=gl.SliceLayout(0, wl))
    return gl.load(router_ptr + e[:, None] * N + c[None, :], mask=(e < num_experts)[:, None], other=0.0)


@gluon.jit
def _router_partial(sgv, rm, wr, plog_ptr, pid_n, num_experts):
    """ROUTER: the token's (row 0's) sg over the strip's BN columns, sgv [BN, BM] as written, against those columns
    of the router weight (wr, _router_load) -> plog[pid_n, :E] float32, the strip's share of the router GEMM (the
    pending norm's 1/rms not applied; the experts' ranking sums the strips, _ranked_expert)."""
    xcol = gl.sum(gl.where((rm == 0)[None, :], sgv.to(gl.float32), 0.0), axis=1)
    xv = gl.convert_layout(xcol, gl.SliceLayout(0, wr.type.layout))
    e = gl.arange(0, wr.shape[0], layout=gl.SliceLayout(1, wr.type.layout))
    gl.store(plog_ptr + pid_n * num_experts + e, gl.sum(wr.to(gl.float32) * xv[None, :], axis=1),
             mask=e < num_experts)


@gluon.jit
def _fp8_tma_ring_kernel(w_desc, x_desc, xs_ptr, ws_ptr, out_ptr, part_ptr, ticket_ptr, res_ptr, g_ptr, sg_ptr, ss_ptr,
                         ss_in_ptr, M, N, K, stride_xs, stride_ws, stride_om, stride_rm, stride_gm, in_strips, eps,
                         ids_ptr, topk_w_ptr,
                         TILES: gl.constexpr, T_PAD: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                         NORM_OUT: gl.constexpr, NORM_IN: gl.constexpr, S_PAD: gl.constexpr, PDL: gl.constexpr,
                         num_warps: gl.constexpr, EXPERT_STRIPS: gl.constexpr = 0, EXPERT_SHARES: gl.constexpr = 0,
                         EXPERT_LATE: gl.constexpr = False, SILU_OUT: gl.constexpr = False, aq_ptr=None, as_ptr=None,
                         fp8_max=1.0, sq_ptr=None, sqs_ptr=None, QUANT_SG: gl.constexpr = False,
                         num_experts=1, RANK: gl.constexpr = False, E_PAD: gl.constexpr = 32,
                         TOP_K: gl.constexpr = 1, SOFTMAX: gl.constexpr = True, RENORMALIZE: gl.constexpr = False,
                         trace_ptr=None, TRACE: gl.constexpr = False, LATE_DEPENDENTS: gl.constexpr = False,
                         R_STRIPS: gl.constexpr = 0, rss_ptr=None, r_eps=0.0, R_SPAD: gl.constexpr = 1,
                         R_EXACT: gl.constexpr = False):
    """The ring form (fp8_tma_ring_linear): x quantized ahead (fp8 rows by TMA, their scales xs [M, K / 128]),
    TILES K tiles a program through STAGES shared-memory stages of a weight tile and its x tile, one mbarrier a
    stage; the first STAGES weight tiles requested before the wait, a stage refilled with the tile STAGES ahead
    once its (synchronous) wgmma has read it. NORM_IN: x is the pending norm's sg, each row scaled at the end by
    its 1/rms from ss_in [16, in_strips] (kernels/triton/linear.py's pending_rstd).

    One token's routed experts (fp8_tma_ring_experts; the weights stacked [E * rows, K], their scales [E * rows /
    128, K / 128]; ids_ptr the token's top-k expert ids, complete before this launch, so read before the wait):
    EXPERT_STRIPS = S (w13): strip pid_n is strip pid_n % S of expert ids[pid_n // S], out [1, top_k * S * 128]
    the pairs' rows side by side. EXPERT_SHARES = S (w2, SPLIT = top_k * S): K share pid_k is share pid_k % S of
    expert ids[pid_k // S]'s K (TILES tiles) over x row pid_k // S (the pair's activation), its scales times
    topk_w[pid_k // S]: the split-K sum is the top-k sum.
    EXPERT_LATE: the ids come from the launch just ahead, so the id and the first stages wait for it.
    SILU_OUT (w13, EXPERT_STRIPS): no gate_up out; each pair's activation silu(gate) * up quantized instead, as
    kernels/triton/activation.py's silu_and_mul_quant_triton writes it (aq [top_k, I] fp8, as [top_k, I / 128]):
    the 2 * SPLIT programs of a gate strip and its up strip write float32 partials and take one ticket, and the
    last of them sums both, a 128-column group of the activation (_silu_out).
    RANK (with EXPERT_STRIPS or EXPERT_SHARES): ids_ptr holds the token's router logits [num_experts] float32,
    not its ids: each program ranks them itself (_ranked_expert) for its pair's expert and routing weight, so the
    routing launch ahead takes no ticket. R_STRIPS > 0 (with RANK): ids_ptr holds the router GEMM's partials
    [R_STRIPS, num_experts] left by the o projection ahead (fp8_tma_linear's ROUTER), rss_ptr the pending norm's
    sums of squares, r_eps its eps (_ranked_expert), so no routing launch runs.
    TRACE (benchmarks.program_trace): the program's start, its wait's release, its first stages requested (with
    EXPERT_LATE after the ranking; slot 5), its first stage landed and its end stamped (_stamp).
    LATE_DEPENDENTS (a RING_PLANS key): the launch after this one is let in (launch_dependents) only once the program
    has requested its last weight tile, not at its wait's release, so that launch's own early weight requests (the
    next layer's qkv ring after the experts' w2, w2 after w13) queue behind this launch's last tiles instead of
    ahead of them."""
    BN_: gl.constexpr = w_desc.block_type.shape[0]
    BK_: gl.constexpr = w_desc.block_type.shape[1]
    BM_: gl.constexpr = x_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BN_
    kb0 = pid_k * TILES
    w_row = pid_n  # the strip's row block in the weight, its first K tile there and in x, x's first row
    wk0 = kb0
    x_row = 0
    if TRACE:
        _stamp(trace_ptr, 0)
    if PDL and EXPERT_LATE:
        tl.extra.cuda.gdc_wait()
        if not LATE_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
    if TRACE and EXPERT_LATE:
        _stamp(trace_ptr, 1)
    if EXPERT_STRIPS > 0:
        if RANK:
            expert, _ = _ranked_expert(ids_ptr, num_experts, pid_n // EXPERT_STRIPS, E_PAD, TOP_K, SOFTMAX,
                                       RENORMALIZE, num_warps, R_STRIPS, rss_ptr, r_eps, R_SPAD, out_ptr, R_EXACT,
                                       NEED_W=False)
        else:
            expert = gl.load(ids_ptr + pid_n // EXPERT_STRIPS)
        w_row = expert * EXPERT_STRIPS + pid_n % EXPERT_STRIPS
    pair_w = 1.0
    if EXPERT_SHARES > 0:
        x_row = pid_k // EXPERT_SHARES
        if RANK:
            expert, pair_w = _ranked_expert(ids_ptr, num_experts, x_row, E_PAD, TOP_K, SOFTMAX, RENORMALIZE,
                                            num_warps, R_STRIPS, rss_ptr, r_eps, R_SPAD, out_ptr, R_EXACT)
        else:
            expert = gl.load(ids_ptr + x_row)
            pair_w = gl.load(topk_w_ptr + x_row)
        w_row = expert * gl.num_programs(0) + pid_n
        wk0 = pid_k % EXPERT_SHARES * TILES

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN_, BK_], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM_, BK_], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(STAGES):  # the weight depends on no kernel ahead
        mbarrier.expect(bars.index(i), nbytes)
        TMA_LOAD(w_desc, [w_row * BN_, (wk0 + i) * BK_], bars.index(i), w_smem.index(i))
    if TRACE:
        _stamp(trace_ptr, 5)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BM_, 256 // w_desc.dtype.primitive_bitwidth])
    rm = gl.arange(0, BM_, layout=gl.SliceLayout(0, mma))
    rn = n0 + gl.arange(0, BN_, layout=gl.SliceLayout(1, mma))
    mask = (rm < M)[None, :] & (rn < N)[:, None]
    vec: gl.constexpr = gl.BlockedLayout([T_PAD], [32], [num_warps], [0])  # every thread holds the whole vector
    tv = gl.arange(0, T_PAD, layout=vec)
    ws = gl.load(ws_ptr + w_row * stride_ws + wk0 + tv, mask=tv < TILES, other=0.0)  # the strip's scales
    g = gl.zeros([BN_], gl.float32, gl.SliceLayout(1, mma))
    if NORM_OUT:
        g = gl.load(g_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
    if PDL and not EXPERT_LATE:  # (kernels/triton/pdl.py's wait_previous)
        tl.extra.cuda.gdc_wait()
        if not LATE_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
    if TRACE and not EXPERT_LATE:
        _stamp(trace_ptr, 1)

    for i in gl.static_range(STAGES):  # x rows past M arrive as zeros (the descriptor's bounds) or go unused
        TMA_LOAD(x_desc, [x_row, (wk0 + i) * BK_], bars.index(i), x_smem.index(i))
    if PDL and LATE_DEPENDENTS and TILES <= STAGES:  # every weight tile requested already
        tl.extra.cuda.gdc_launch_dependents()
    r = gl.zeros([BN_, BM_], gl.float32, mma)
    if NORM_OUT:
        r = gl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0).to(gl.float32)
    # the rows' scales of the program's K tiles, tile-major, through shared memory (read a tile at a time below)
    sl: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    j = gl.arange(0, T_PAD * BM_, layout=sl)
    xs = gl.load(xs_ptr + (x_row + j % BM_) * stride_xs + wk0 + j // BM_, mask=(j % BM_ < M) & (j // BM_ < TILES),
                 other=0.0)
    if EXPERT_SHARES > 0:
        xs = xs * pair_w
    xs_smem = gl.allocate_shared_memory(gl.float32, [T_PAD * BM_], gl.SwizzledSharedLayout(1, 1, 1, order=[0]), xs)
    rstd = gl.full([BM_], 1.0, gl.float32, gl.SliceLayout(0, mma))
    if NORM_IN:
        nl: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [1, num_warps], [1, 0])
        sp = gl.arange(0, S_PAD, layout=gl.SliceLayout(1, nl))
        rr = gl.arange(0, BM_, layout=gl.SliceLayout(0, nl))
        ss_in = gl.load(ss_in_ptr + rr[None, :] * in_strips + sp[:, None],
                        mask=(rr < M)[None, :] & (sp < in_strips)[:, None], other=0.0)
        rstd = gl.convert_layout(gl.rsqrt(gl.sum(ss_in, axis=0) / K + eps), gl.SliceLayout(0, mma))
    CTA_BARRIER()  # the scales are in shared memory before any thread reads another's

    acc = gl.zeros([BN_, BM_], gl.float32, mma)
    for i in gl.static_range(TILES):
        st = i % STAGES
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        if TRACE and i == 0:
            _stamp(trace_ptr, 2)
        d = warpgroup_mma(w_smem.index(st), x_smem.index(st).permute((1, 0)), gl.zeros([BN_, BM_], gl.float32, mma),
                          use_acc=False)
        acc += d * (xs_smem.slice(i * BM_, BM_).load(gl.SliceLayout(0, mma)) * _pick(ws, i, vec))[None, :]
        if i + STAGES < TILES:  # the wgmma above is synchronous: stage st is free again
            mbarrier.expect(bars.index(st), nbytes)
            TMA_LOAD(w_desc, [w_row * BN_, (wk0 + i + STAGES) * BK_], bars.index(st), w_smem.index(st))
            TMA_LOAD(x_desc, [x_row, (wk0 + i + STAGES) * BK_], bars.index(st), x_smem.index(st))
            if PDL and LATE_DEPENDENTS and i + STAGES == TILES - 1:  # the last weight tile requested
                tl.extra.cuda.gdc_launch_dependents()
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if NORM_IN:
        acc = acc * rstd[None, :]
    if SILU_OUT:
        _silu_out(acc, part_ptr, ticket_ptr, aq_ptr, as_ptr, out_ptr, fp8_max, rm, rn, mask, pid_n, pid_k, M, N,
                  EXPERT_STRIPS, SPLIT)
    else:
        _finish(acc, out_ptr, part_ptr, ticket_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, pid_k, N, stride_om,
                stride_gm, SPLIT, NORM_OUT, sq_ptr, sqs_ptr, fp8_max, QUANT_SG, None, None, 0, False, 32, num_warps)
    if TRACE:
        _stamp(trace_ptr, 3)


@gluon.jit
def _ranked_expert(logits_ptr, num_experts, slot, E_PAD: gl.constexpr, TOP_K: gl.constexpr, SOFTMAX: gl.constexpr,
                   RENORMALIZE: gl.constexpr, num_warps: gl.constexpr, R_STRIPS: gl.constexpr = 0, ss_ptr=None,
                   eps=0.0, S_PAD: gl.constexpr = 1, round_ptr=None, R_EXACT: gl.constexpr = False,
                   NEED_W: gl.constexpr = True):
    """(expert id, routing weight) of top-k slot `slot` of one token's router logits [num_experts] float32, every
    warp holding all E_PAD logits (its reductions stay within the warp): at sigmoid scoring the scores, keys and
    rounds of kernels/triton/routing.py's topk_of_rows (ties to the lower id), at softmax _ranked_logit's.
    NEED_W False: the expert only (its weight 1.0). R_STRIPS > 0: logits_ptr holds the router GEMM's
    partial sums [R_STRIPS, num_experts] over strips of 128 columns of a pending norm's sg (the o projection's
    ROUTER), summed here, scaled by the norm's 1/rms from ss_ptr's row 0 [R_STRIPS] (eps) and rounded to
    round_ptr's dtype, as route_token_triton writes the logits; R_EXACT (num_experts == E_PAD): read unmasked, four
    floats a load."""
    lay: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
    ex = gl.arange(0, E_PAD, layout=lay)
    ok = ex < num_experts
    if R_STRIPS > 0:
        sp = gl.arange(0, S_PAD, layout=lay)
        ss = gl.load(ss_ptr + sp, mask=sp < R_STRIPS, other=0.0)
        x = gl.zeros([E_PAD], gl.float32, lay)
        for st in gl.static_range(R_STRIPS):
            if R_EXACT:
                x += gl.load(logits_ptr + st * E_PAD + ex)
            else:
                x += gl.load(logits_ptr + st * num_experts + ex, mask=ok, other=0.0)
        x *= gl.rsqrt(gl.sum(ss, axis=0) / (R_STRIPS * 128) + eps)
        x = gl.where(ok, x.to(round_ptr.dtype.element_ty).to(gl.float32), float("-inf"))
    else:
        x = gl.load(logits_ptr + ex, mask=ok, other=float("-inf"))
    if SOFTMAX:
        expert, w = _ranked_logit(x, ok, ex, slot, round_ptr.dtype.element_ty, E_PAD, TOP_K, RENORMALIZE, NEED_W)
    else:
        scores = 1 / (1 + gl.exp(-x))
        keys = (scores.to(gl.int32, bitcast=True).to(gl.int64) << 32) | (E_PAD - 1 - ex)
        keys = gl.where(ok, keys, -1)
        total = 0.0
        for i in gl.static_range(TOP_K):
            best = gl.max(keys, axis=0)
            total += (best >> 32).to(gl.int32).to(gl.float32, bitcast=True)
            picked = best if i == 0 else gl.where(slot == i, best, picked)
            keys = gl.where(keys == best, -1, keys)
        w = (picked >> 32).to(gl.int32).to(gl.float32, bitcast=True)
        if RENORMALIZE:
            w = w / total
        expert = (E_PAD - 1 - (picked & 0xFFFFFFFF)).to(gl.int32)
    return expert, w


@gluon.jit
def _ranked_logit(x, ok, ex, slot, dtype: gl.constexpr, E_PAD: gl.constexpr, TOP_K: gl.constexpr,
                  RENORMALIZE: gl.constexpr, NEED_W: gl.constexpr):
    """_ranked_expert at softmax scoring: the logits x (float32 holding values of the 16-bit dtype, the router GEMM's
    rounded output) ranked by their 16-bit codes, made monotone and packed with the expert's index into one int32
    key (ties to the lower id): a round is one 32-bit warp max, and no softmax runs ahead of the ranking. The
    softmax keeps the logits' order, so these are the experts the scores rank, but for logits closer than the
    float32 exp resolves (~1e-7 apart), which the scores would tie to the lower id (or, with exp's rounding, even
    invert). NEED_W (w2): the routing weight too, the softmax score exp(l - max) / sum bit for bit as the scores
    were computed before the ranking went to codes (each term recomputed from its logit); without it (w13) the
    rounds stop at the program's slot."""
    code = x.to(dtype).to(gl.int16, bitcast=True).to(gl.int32)
    keys = gl.where(ok, (gl.where(code < 0, -32768 - code, code) << 16) | (E_PAD - 1 - ex), -2147483647)
    picked = gl.max(keys, axis=0)
    w = 1.0
    if NEED_W:
        mx = _key_logit(picked, dtype)
        s = gl.sum(gl.exp(x - mx), axis=0)
        best = picked
        total = gl.exp(mx - mx) / s
        for i in gl.static_range(1, TOP_K):
            keys = gl.where(keys == best, -2147483647, keys)
            best = gl.max(keys, axis=0)
            total += gl.exp(_key_logit(best, dtype) - mx) / s
            picked = gl.where(slot == i, best, picked)
        w = gl.exp(_key_logit(picked, dtype) - mx) / s
        if RENORMALIZE:
            w = w / total
    else:
        for i in gl.static_range(1, TOP_K):
            if i <= slot:
                keys = gl.where(keys == picked, -2147483647, keys)
                picked = gl.max(keys, axis=0)
    return (E_PAD - 1 - (picked & 0xFFFF)).to(gl.int32), w


@gluon.jit
def _key_logit(key, dtype: gl.constexpr):
    """The float32 logit of _ranked_logit's key (its high 16 bits, the monotone code)."""
    k = key >> 16
    return gl.where(k < 0, -32768 - k, k).to(gl.int16).to(dtype, bitcast=True).to(gl.float32)


@gluon.jit
def _silu_out(acc, part_ptr, ticket_ptr, aq_ptr, as_ptr, out_ptr, fp8_max, rm, rn, mask, pid_n, pid_k, M, N,
              STRIPS: gl.constexpr, SPLIT: gl.constexpr, done_ptr=None, SIGNAL: gl.constexpr = False):
    """SILU_OUT's epilogue: acc [BN, BM] is strip pid_n's K share pid_k (STRIPS strips a pair: its gate's, then its
    up's). The partial goes to part [SPLIT, BM, N]; the last of the 2 * SPLIT programs of gate strip j and up strip
    j + STRIPS / 2 sums both (each rounded to the output dtype, as gate_up would hold them), and writes silu(gate)
    * up rounded, quantized as one group of 128 columns: aq[pair, j * 128 + c], as[pair, j]. mask (the rows below
    M; a strip's rows are all within N) serves the partials' reads as it did their writes. SIGNAL: that program
    then raises done_ptr[pair], the pair's count of groups written (release), for readers in the same launch
    (kernels/triton/fp8_tma_moe.py)."""
    BN_: gl.constexpr = acc.shape[0]
    BM_: gl.constexpr = acc.shape[1]
    HALF: gl.constexpr = STRIPS // 2
    gl.store(part_ptr + (pid_k * BM_ + rm[None, :]) * N + rn[:, None], acc, mask=mask)
    CTA_BARRIER()  # every thread's partial is written before the ticket is taken
    pair = pid_n // STRIPS
    j = pid_n % STRIPS % HALF
    ticket = ticket_ptr + pair * HALF + j
    if gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == 2 * SPLIT - 1:
        rr = rn - pid_n * BN_  # the strip's rows 0..BN-1
        g0 = (pair * STRIPS + j) * BN_
        gate = gl.zeros_like(acc)
        up = gl.zeros_like(acc)
        for sp in gl.static_range(SPLIT):
            rows = part_ptr + (sp * BM_ + rm[None, :]) * N + g0 + rr[:, None]
            gate += gl.load(rows, mask=mask, other=0.0, cache_modifier=".cg")
            up += gl.load(rows + HALF * BN_, mask=mask, other=0.0, cache_modifier=".cg")
        dt: gl.constexpr = out_ptr.dtype.element_ty
        gate = gate.to(dt).to(gl.float32)
        act = (gate / (1.0 + gl.exp(-gate))).to(dt).to(gl.float32)  # silu rounded first, as the reference
        y = gl.where(mask, (act * up.to(dt).to(gl.float32)).to(dt).to(gl.float32), 0.0)
        q, s = _quant_group(y, fp8_max, aq_ptr.dtype.element_ty)
        gl.store(aq_ptr + pair * (HALF * BN_) + j * BN_ + rr[:, None] + rm[None, :] * 0, q, mask=mask)
        gl.store(as_ptr + pair * HALF + j + rm * 0, s, mask=rm < M)
        gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
        if SIGNAL:
            CTA_BARRIER()  # every thread's stores are made before the count is raised
            gl.atomic_add(done_ptr + pair, 1, sem="release", scope="gpu")


@gluon.jit
def _quant_group(y, fp8_max, q_ty: gl.constexpr):
    """y [BN, BM] float32, each of its BM rows' BN columns one group -> (y / s clamped, in q_ty; s [BM] =
    max(amax(|y|) / fp8_max, 1e-12)): quantize_rows_triton's arithmetic (fp8_skinny._quant_tile), transposed."""
    s = gl.maximum(gl.max(gl.abs(y), axis=0) / fp8_max, 1e-12)
    return gl.minimum(gl.maximum(y / s[None, :], -fp8_max), fp8_max).to(q_ty), s


@gluon.jit
def _write_out(acc, out_ptr, sg_ptr, ss_ptr, r, g, rm, rn, mask, pid_n, stride_om, stride_gm, NORM_OUT: gl.constexpr,
               sq_ptr, sqs_ptr, fp8_max, QUANT_SG: gl.constexpr, STRIPS_OUT: gl.constexpr = 0):
    """acc [BN, BM] (out.T) -> out; NORM_OUT: out = s = acc (rounded) + the residual r [BN, BM], sg = s * g [BN]
    rounded, and the strip's sums of squares of s's rows at ss [BM, strips] (kernels/triton/linear.py's
    pend_norm; strips: STRIPS_OUT, or with 0 the grid's first axis, a program a strip there). QUANT_SG (with NORM_OUT): sg's rows also quantized as one group of the strip's BN columns, as
    quantize_rows_triton quantizes them (sq [M, N] fp8 with sg's row stride, sqs [BM, strips] float32; rows past
    M: scale 1e-12), the next FP8 GEMM's input with the norm still pending (kernels.fp8.fp8_linear_normed).
    Returns sg as written (NORM_OUT), else out."""
    y = acc.to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
    if STRIPS_OUT > 0:
        strips = STRIPS_OUT
    else:
        strips = gl.num_programs(0)
    if NORM_OUT:
        s = (y.to(gl.float32) + r).to(y.dtype)
        gl.store(out_ptrs, s, mask=mask)
        sf = gl.where(mask, s.to(gl.float32), 0.0)
        gl.store(ss_ptr + rm * strips + pid_n, gl.sum(sf * sf, axis=0))
        if rm.shape[0] == 8:  # (fp8_tma_linear's 8-row programs) ss keeps 16 rows: those past 8 hold zeros
            gl.store(ss_ptr + (rm + 8) * strips + pid_n, gl.zeros_like(rm).to(gl.float32))
        sgv = (sf * g[:, None]).to(y.dtype)
        gl.store(sg_ptr + rm[None, :] * stride_gm + rn[:, None], sgv, mask=mask)
        if QUANT_SG:
            q, sc = _quant_group(gl.where(mask, sgv.to(gl.float32), 0.0), fp8_max, sq_ptr.dtype.element_ty)
            gl.store(sq_ptr + rm[None, :] * stride_gm + rn[:, None], q, mask=mask)
            gl.store(sqs_ptr + rm * strips + pid_n, sc)
    else:
        gl.store(out_ptrs, y, mask=mask)
        sgv = y
    return sgv


SMEM_PER_SM = 227 * 1024
TILE_SMEM = BN * BK + BM * BK * 3 + BM * 4  # a weight tile, its x rows staged in bf16 and quantized, their scales

# Measured splits: (N, K) -> {"SPLIT": s}, where one beat split_for's rule in a decode step
# (benchmarks.ab_decode with a plan_tune-style file: {"walks": [{"what": "tma (N, K)", "best": {"SPLIT": s}}]}).
# "ROWS": the x rows a program stages, 16 or (for M <= 8) 8, which rows_for picks by default.
PLANS: dict[tuple[int, int], dict] = {
    # Qwen3-30B-A3B's o projection at one token (merging the attention's partials, one head a program): 32 K shares,
    # not the rule's 16; the b=1 step on an H200 1.988 -> 1.949 ms, tokens equal (SPLIT 8: 2.124; RESULTS.md,
    # thirty-third session)
    (2048, 4096): {"SPLIT": 32},
    # Llama-3-8B's o projection (and any 4096 x 4096) at up to 16 rows: 16 K shares (512 programs of 2 tiles), not
    # the rule's 8 (256 of 4). Beside the split-K attention at 128 registers (KV_READBACK) all 512 get in before the
    # merge ends, against ~30 of the 256 starting only at its end (benchmarks.program_trace). H100 b=1 step, two
    # processes on one machine (2026-12-07): 3.257 -> 3.221 and 3.261 -> 3.220 ms, 4 shares 3.307; before
    # KV_READBACK 16 shares had lost (H100 3.176 against 3.162, H200 2.573 against 2.557; RESULTS.md)
    (4096, 4096): {"SPLIT": 16},
}


def rows_for(m: int, n: int, k: int) -> int:
    """The x rows (the wgmma's N) a program of fp8_tma_linear stages for M = m: 8 where m <= 8, which leaves
    the Llama-3-8B o projection's programs at the rule's SPLIT 8 77 KB of shared memory, not 88 (at its PLANS
    entry's 16, 39 KB): by shared memory two of them fit an SM beside a split-K attention program at 2 stages
    (68 KB; 36 KB at the rule's one, where 16-row programs fit too). By registers, with KV_EARLY's tile put in
    from registers that attention program (8 warps) takes 248-254 registers a thread (ptxas 12.8 with Triton 3.6,
    and 13.4), all of an SM's 64K (sm_90 compiles, thirty-eighth session; an o program: 102 registers, 4 warps).
    With KV_READBACK (the rule's since the fortieth session) it takes 128: two 8-row programs fit beside it by
    registers too, two 16-row ones (192) do not."""
    return PLANS.get((n, k), {}).get("ROWS", 8 if m <= 8 else 16)


def split_for(n: int, k: int, sms: int) -> int | None:
    """SPLIT for a weight [N, K]: PLANS's, else the fewest K shares (a power of two) that give the grid a program
    an SM (or a tile a program), each share at most MAX_TILES tiles; None where the shares do not divide K's tiles,
    or where the grid's shared memory does not fit the GPU at once (programs of a second wave could not load
    ahead of the wait)."""
    strips, tiles = n // BN, k // BK
    split = 1
    while split < tiles and (strips * split < sms or tiles // split > MAX_TILES):
        split *= 2
    split = PLANS.get((n, k), {}).get("SPLIT", split)
    if tiles % split or tiles // split > MAX_TILES:
        return None
    per_program = tiles // split * TILE_SMEM
    if strips * split > sms * (SMEM_PER_SM // per_program):
        return None
    return split


def supports(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether this kernel takes x [M, K] @ w.T: 1..16 rows of bf16/fp16, an e4m3 weight [N, K] with (128, 128)
    blocks, N and K multiples of 128, a split of K within MAX_TILES tiles a program."""
    m, k = x.shape
    n = w.shape[0]
    return (0 < m <= BM and block == (BN, BK) and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == torch.float8_e4m3fn and n % BN == 0 and k % BK == 0 and w.shape[1] == k
            and n // BN <= MAX_TICKETS and split_for(n, k, num_sms(x.device)) is not None)


def _w_desc(w: torch.Tensor) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    return TensorDescriptor.from_tensor(w, [BN, BK], layout)


def fp8_tma_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, pdl: bool = True, split: int | None = None,
                   sg_quant: tuple[torch.Tensor, torch.Tensor] | None = None, trace: list | None = None,
                   router: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.fp8.fp8_linear_ref for x [M <= 16, K] bf16/fp16, w [N, K] e4m3 with w_scale [N / 128, K / 128]
    (supports()). With residual [M, N] and norm_weight [N]: (s = x @ w.T + residual, sg = s * norm_weight,
    ss [16, N / 128] float32 the strips' sums of squares of s's rows), as fp8_skinny_add_norm_triton; else
    (out, out, out). split: K shares a strip (default split_for). x may be one token's decode attention output
    left as its split-K partials (kernels.linear.SplitPartials, heads of 128): each program merges its K share's
    heads itself (MERGE), so no merge launch runs between the attention and this GEMM. sg_quant (with residual;
    sg_quant_buffers): sg also written quantized there (QUANT_SG). trace: a list this launch appends ("tma_gemm", its
    program clocks) to, int64 [N / 128 * split, 8], program (pid_n, pid_k) at row pid_n * split + pid_k, columns 0-4
    written by every launch (kernels/triton/trace.py; _stamp; benchmarks.program_trace reads them). router = (gate
    [E, N] in x's dtype, plog [N / 128, E] float32), with residual and one row: each strip's share of the router
    GEMM sg @ gate.T written to plog (ROUTER; the pending norm's 1/rms not applied), which the experts' ring sums
    and ranks (fp8_tma_ring_experts' ranked partials), so no routing launch runs between."""
    parts = x if isinstance(x, SplitPartials) else None
    if parts is not None:
        if parts.acc.shape[-1] != BK or parts.acc.shape[0] != 1:
            raise ValueError(f"fp8_tma_linear: partials of one token and heads of {BK}, got {tuple(parts.acc.shape)}")
        x = parts.rows
    m, k = x.shape
    n = w.shape[0]
    split = split or split_for(n, k, num_sms(x.device))
    x = x if x.stride(-1) == 1 or parts is not None else x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    norm = residual is not None
    sg = torch.empty_like(out) if norm else out
    ss = torch.empty(BM, n // BN, device=x.device, dtype=torch.float32) if norm else out
    part = torch.empty(split, BM, n, device=x.device, dtype=torch.float32) if split > 1 else out
    if norm:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    res, g = (residual, norm_weight) if norm else (out, out)
    w_scale = w_scale.contiguous()
    route = {}
    if router is not None:
        gate, plog = router
        e = gate.shape[0]
        if not (norm and m == 1 and gate.shape == (e, n) and gate.dtype == x.dtype and gate.is_contiguous()
                and plog.shape == (n // BN, e) and plog.dtype == torch.float32):
            raise ValueError(f"fp8_tma_linear: router needs the residual, one row, a contiguous gate [E, {n}] in "
                             f"{x.dtype} and plog [{n // BN}, E] float32")
        route = dict(router_ptr=gate, plog_ptr=plog, num_experts=e, ROUTER=True,
                     E_PAD=max(32, triton.next_power_of_2(e)))
    _fp8_tma_kernel[(n // BN, split)](
        _w_desc(w), out if parts is not None else x, w_scale, out, part, tickets(x.device), res, g, sg, ss, m, n,
        0 if parts is not None else x.stride(0), w_scale.stride(0),
        out.stride(0), res.stride(0), sg.stride(0), float(torch.finfo(w.dtype).max), TILES=k // BK // split,
        SPLIT=split, NORM_OUT=norm, num_warps=4, BM_=rows_for(m, n, k),
        **(dict(pacc_ptr=parts.acc, pml_ptr=parts.ml, seq_lens_ptr=parts.seq_lens, MERGE=parts.acc.shape[2],
                KV_BLOCK=parts.block_n) if parts is not None else {}), **_sg_quant_args(sg_quant, norm),
        **trace_args(trace, "tma_gemm", n // BN * split, x.device), **route, **launch_args(out, pdl))
    return out, sg, ss


def sg_quant_buffers(m: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, n] e4m3, s [BM, n / BN] float32): where a decode GEMM with NORM_OUT writes sg quantized in groups of
    BN columns (QUANT_SG), as quantize_rows_triton would write them for the next GEMM (its first m rows of s)."""
    return (torch.empty(m, n, device=device, dtype=torch.float8_e4m3fn),
            torch.empty(BM, n // BN, device=device, dtype=torch.float32))


def _sg_quant_args(sg_quant: tuple[torch.Tensor, torch.Tensor] | None, norm: bool) -> dict:
    if sg_quant is None:
        return {}
    if not norm:
        raise ValueError("sg_quant needs the residual and norm weight (NORM_OUT)")
    return dict(sq_ptr=sg_quant[0], sqs_ptr=sg_quant[1], QUANT_SG=True)


# ---- the ring form: x quantized ahead, any number of K tiles a program --------------------------------------

STAGE_SMEM = BN * BK + BM * BK  # a weight tile and its x tile
# Rows the ring form takes in the decode step: in it on an H200 it won at 1 row (Llama-3-8B 2.667 -> 2.572 ms,
# Qwen3-30B-A3B 2.390 -> 2.368) and lost at 16 (3.600 -> 3.835, 6.717 -> 6.923; benchmarks/RESULTS.md);
# at 16 rows again with plans that won alone (3.602 -> 3.846; its gate_up slows the o GEMM ahead); with 64-row x
# tiles it lost to the Triton 64-row GEMM (the b=64 step 6.570 against 5.091 ms, gate_up alone 50.0 against 37.4 us)
RING_MAX_ROWS = 1
RING_FIXED_SMEM = 2048  # the barriers and the compiler's scratch (a layout conversion, a reduction)
MAX_STAGES = 8
# Measured plans: (N, K) -> {"SPLIT": s, "STAGES": t}, where one beat ring_plan's rule in a decode step
# (benchmarks.ab_decode plans=F, F a walk {"what": "tma ring (N, K)", "best": {...}}); (H, I, top_k) -> {"STAGES":
# t, "SHARES": s} for the experts' ring w2 (fp8_tma_ring_experts: s K shares an expert, _w2_plan). Either may set
# "LATE_DEPENDENTS": True (late_dependents; the kernel's docstring).
RING_PLANS: dict[tuple[int, ...], dict] = {
    # Qwen3-30B-A3B's ring w13 (8 experts' 1536 x 2048 side by side): 5 stages, not the rule's 6 (4: no change); the
    # b=1 step on an H200 2.095 -> 2.085 ms in every round, tokens equal (RESULTS.md, thirtieth session). Also a dense
    # 12288 x 2048 on the ring (Qwen3-1.7B's gate_up), not measured there.
    (12288, 2048): {"SPLIT": 2, "STAGES": 5},
    # Qwen3-30B-A3B's experts' w2 (8 experts' 2048 x 768, one K share an expert): 5 stages, not the rule's 6. On an
    # H100 the b=1 step 2.168 -> 2.110-2.122 ms (6: 2.131-2.141; 3: 2.265; RESULTS.md, thirty-seventh session); on
    # an H200 4 stages had beaten 6 (2.006 -> 1.990 ms, thirty-second session), 5 not measured there
    (2048, 768, 8): {"STAGES": 5},
    # Llama-3-8B's ring qkv (6144 x 4096): the rule's plan with LATE_DEPENDENTS, so the o launch after attention is let
    # in once qkv's last weight tile is requested. On an H100 the b=1 step 3.243-3.247 -> 3.228-3.230 ms in three
    # processes, tokens equal (down's and gate_up's rings with it: no gain; RESULTS.md, forty-third session)
    (6144, 4096): {"SPLIT": 4, "STAGES": 6, "LATE_DEPENDENTS": True},
}


def late_dependents(key: tuple) -> dict:
    """The ring kernel's LATE_DEPENDENTS for RING_PLANS's key (N, K) or, for the experts' w2, (H, I, top_k): the
    plan's "LATE_DEPENDENTS" (default off), as the launch's keyword."""
    return dict(LATE_DEPENDENTS=bool(RING_PLANS.get(key, {}).get("LATE_DEPENDENTS", False)))


def ring_plan(n: int, k: int, sms: int) -> tuple[int, int] | None:
    """(SPLIT, STAGES) for a weight [N, K] on the ring form: RING_PLANS's, else the fewest K shares (a power of
    two dividing K's tiles) that give every SM a program, and as many stages (at most MAX_STAGES, at most the
    share's tiles) as the programs an SM then holds leave shared memory for; None where a RING_PLANS split does
    not divide K's tiles or fewer than two stages fit."""
    strips, tiles = n // BN, k // BK
    split = 1
    while strips * split < sms and tiles % (2 * split) == 0:
        split *= 2
    plan = RING_PLANS.get((n, k), {})
    split = plan.get("SPLIT", split)
    if tiles % split:
        return None
    stages = plan.get("STAGES", _ring_stages(strips * split, tiles // split, sms))
    return (split, stages) if stages >= min(2, tiles // split) else None


def _ring_stages(programs: int, tiles: int, sms: int) -> int:
    """As many stages (at most MAX_STAGES, at most the program's tiles) as the programs an SM holds leave shared
    memory for."""
    per_sm = -(-programs // sms)
    room = SMEM_PER_SM // per_sm - RING_FIXED_SMEM - triton.next_power_of_2(tiles) * BM * 4
    return min(MAX_STAGES, tiles, room // STAGE_SMEM)


def ring_supports(m: int, w: torch.Tensor, block: tuple[int, int] | None, device: torch.device) -> bool:
    """Whether the decode step runs m rows quantized ahead (groups of 128) @ w.T on fp8_tma_ring_linear (which takes
    1..16): up to RING_MAX_ROWS rows, an e4m3 weight [N, K] with (128, 128) blocks, N and K multiples of 128, a
    ring_plan."""
    n, k = w.shape
    return (0 < m <= RING_MAX_ROWS and block == (BN, BK) and w.dtype == torch.float8_e4m3fn
            and n % BN == 0 and k % BK == 0 and n // BN <= MAX_TICKETS and ring_plan(n, k, num_sms(device)) is not None)


def fp8_tma_ring_linear(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        dtype: torch.dtype, residual: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None, norm_in: tuple[torch.Tensor, float] | None = None,
                        pdl: bool = True, plan: tuple[int, int] | None = None,
                        sg_quant: tuple[torch.Tensor, torch.Tensor] | None = None, trace: list | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.fp8._quantized_linear_ref for rows quantized ahead: xq [M <= 16, K] e4m3, xs [M, K / 128] float32
    (quantize_rows with groups of 128), w [N, K] e4m3 with w_scale [N / 128, K / 128] (ring_supports) -> out
    [M, N] in dtype. residual [M, N] and norm_weight [N] (NORM_OUT): (s, sg, ss) as fp8_tma_linear. norm_in
    (ss [16, strips] float32, eps): xq is a pending norm's sg quantized, the output scaled by each row's 1/rms.
    plan: (SPLIT, STAGES), default ring_plan. sg_quant: as fp8_tma_linear's. trace: as fp8_tma_linear's, the launch
    named "ring NxK" (TRACE; its weight-in column: the first stage landed)."""
    m, k = xq.shape
    n = w.shape[0]
    if not 0 < m <= BM:
        raise ValueError(f"fp8_tma_ring_linear: {m} rows (at most {BM})")
    norm = residual is not None
    split, stages = plan or ring_plan(n, k, num_sms(xq.device))
    tiles = k // BK // split
    out = torch.empty(m, n, device=xq.device, dtype=dtype)
    sg = torch.empty_like(out) if norm else out
    ss = torch.empty(BM, n // BN, device=xq.device, dtype=torch.float32) if norm else out
    part = torch.empty(split, BM, n, device=xq.device, dtype=torch.float32) if split > 1 else out
    if norm:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    res, g = (residual, norm_weight) if norm else (out, out)
    ss_in, eps = norm_in if norm_in is not None else (out, 0.0)
    xq = xq if xq.stride(-1) == 1 and xq.stride(0) % 16 == 0 else xq.contiguous()
    x_desc = TensorDescriptor.from_tensor(xq, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))
    w_scale = w_scale.contiguous()
    _fp8_tma_ring_kernel[(n // BN, split)](
        _w_desc(w), x_desc, xs, w_scale, out, part, tickets(xq.device), res, g, sg, ss, ss_in, m, n, k, xs.stride(0),
        w_scale.stride(0), out.stride(0), res.stride(0), sg.stride(0), ss_in.shape[1] if norm_in else 1, eps, out, out,
        TILES=tiles, T_PAD=triton.next_power_of_2(tiles), STAGES=min(stages, tiles), SPLIT=split, NORM_OUT=norm,
        NORM_IN=norm_in is not None, S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in else 1, num_warps=4,
        fp8_max=float(torch.finfo(torch.float8_e4m3fn).max), **_sg_quant_args(sg_quant, norm),
        **trace_args(trace, f"ring {n}x{k}", n // BN * split, xq.device), **late_dependents((n, k)),
        **launch_args(xq, pdl))
    return out, sg, ss


def _x_desc(xq: torch.Tensor) -> TensorDescriptor:
    xq = xq if xq.stride(-1) == 1 and xq.stride(0) % 16 == 0 else xq.contiguous()
    return TensorDescriptor.from_tensor(xq, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))


def ring_experts_supports(m: int, w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None, top_k: int,
                          device: torch.device) -> bool:
    """Whether fp8_tma_ring_experts takes m tokens' routed experts: one token, e4m3 experts w13 [E, 2I, H] and w2
    [E, H, I] with (128, 128) blocks, 2I, H and I multiples of 128, a ring_plan for the top-k pairs' w13 strips side
    by side, two stages for w2 (a K share an expert)."""
    e, two_i, h = w13.shape
    return (m == 1 and block == (BN, BK) and w13.dtype == w2.dtype == torch.float8_e4m3fn
            and tuple(w2.shape) == (e, h, two_i // 2) and two_i % (2 * BN) == 0 and h % BN == 0
            and top_k * two_i // BN <= MAX_TICKETS and ring_plan(top_k * two_i, h, num_sms(device)) is not None
            and _ring_stages(h // BN * top_k, two_i // 2 // BK, num_sms(device)) >= min(2, two_i // 2 // BK))


def fp8_tma_ring_experts(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                         w2: torch.Tensor, w2_scale: torch.Tensor, ids: torch.Tensor, topk_w: torch.Tensor,
                         dtype: torch.dtype, norm_in: tuple[torch.Tensor, float] | None = None,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         pdl: bool = True, early: bool = True, ids_late: bool = False, silu_out: bool = True,
                         sg_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ranked: tuple[torch.Tensor, int, bool, str] | None = None, trace: list | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's routed experts on the ring form, every expert held here (ring_experts_supports): xq [1, H] e4m3
    and xs [1, H / 128] its row quantized ahead (norm_in: a pending norm's sg, as fp8_tma_ring_linear takes it);
    w13 [E, 2I, H], w2 [E, H, I] e4m3 with scales [E, 2I / 128, H / 128], [E, H / 128, I / 128]; ids [1, k] int32,
    topk_w [1, k] float32 from a launch before the one ahead of this (read before the wait; ids_late: from the
    launch just ahead, which w13 then waits for before it reads them: EXPERT_LATE). Two launches: w13 for the k
    pairs' strips side by side (EXPERT_STRIPS) writing each pair's activation silu(gate) * up quantized (SILU_OUT),
    then w2 with a K share a pair, or S shares (EXPERT_SHARES; _w2_plan), whose split-K sum is the top-k sum.
    silu_out False (KernelConfig.fp8_tma_ring_moe_silu off): w13 writes gate_up and the SiLU-and-mul is a launch between (early:
    letting w2 in before its wait). On an H200 the fused form took the Qwen3-30B-A3B b=1 step from 2.105 to 2.087
    ms (benchmarks/RESULTS.md). -> (out [1, H] in dtype, sg, ss) as fp8_tma_ring_linear (residual and norm_weight:
    NORM_OUT; sg_quant: as fp8_tma_linear's). ranked = (logits [E] float32, top_k, renormalize, scoring), with
    ids and topk_w None and ids_late: the router's logits from the launch just ahead (route_token_triton with rank
    False), which every program of both launches ranks itself (RANK); logits [S, E] (with norm_in): the router
    GEMM's partials over S strips of x's columns, left by the o projection ahead (fp8_tma_linear's router), which
    the programs sum and scale by the pending norm's 1/rms before ranking (R_STRIPS). trace: as
    fp8_tma_ring_linear's, the launches named "w13" and "w2"."""
    from tandem.kernels.triton.activation import silu_and_mul_quant_triton
    e, two_i, h = w13.shape
    dev = xq.device
    if ranked is not None:
        if not ids_late or ids is not None or topk_w is not None:
            raise ValueError("fp8_tma_ring_experts: ranked logits come from the launch just ahead (ids_late), "
                             "in place of ids and topk_w")
        logits, top_k, renormalize, scoring = ranked
        ids = topk_w = logits
        rank = dict(num_experts=e, RANK=True, E_PAD=max(32, triton.next_power_of_2(e)), TOP_K=top_k,
                    SOFTMAX=scoring == "softmax", RENORMALIZE=renormalize)
        if logits.dim() == 2:  # partials [S, E] over strips of 128 of the pending norm's sg
            strips = logits.shape[0]
            if norm_in is None or logits.shape[1] != e or strips * BK != h or norm_in[0].shape[1] != strips:
                raise ValueError(f"fp8_tma_ring_experts: router partials [{h // BK}, {e}] need the pending norm "
                                 f"ahead (norm_in), got {tuple(logits.shape)}")
            rank.update(R_STRIPS=strips, rss_ptr=norm_in[0], r_eps=norm_in[1], R_SPAD=triton.next_power_of_2(strips),
                        R_EXACT=e == rank["E_PAD"])
    else:
        top_k, rank = ids.shape[-1], {}
    inter = two_i // 2
    ids, topk_w = ids.reshape(-1).contiguous(), topk_w.reshape(-1).contiguous()
    n1 = top_k * two_i
    split, stages = ring_plan(n1, h, num_sms(dev))
    gate_up = torch.empty(1, 1 if silu_out else n1, device=dev, dtype=dtype)  # (its dtype only, with silu_out)
    part = torch.empty(split, BM, n1, device=dev, dtype=torch.float32) if split > 1 or silu_out else gate_up
    aq = torch.empty(top_k, inter, device=dev, dtype=xq.dtype) if silu_out else None
    a_s = torch.empty(top_k, inter // BK, device=dev, dtype=torch.float32) if silu_out else None
    ss_in, eps = norm_in if norm_in is not None else (gate_up, 0.0)
    s13 = w13_scale.reshape(e * two_i // BN, -1)
    tiles = h // BK // split
    _fp8_tma_ring_kernel[(n1 // BN, split)](
        _w_desc(w13.view(e * two_i, h)), _x_desc(xq), xs, s13, gate_up, part, tickets(dev), gate_up, gate_up,
        gate_up, gate_up, ss_in, 1, n1, h, xs.stride(0), s13.stride(0), gate_up.stride(0), 0, 0,
        ss_in.shape[1] if norm_in else 1, eps, ids, topk_w, TILES=tiles, T_PAD=triton.next_power_of_2(tiles),
        STAGES=min(stages, tiles), SPLIT=split, NORM_OUT=False, NORM_IN=norm_in is not None,
        S_PAD=triton.next_power_of_2(ss_in.shape[1]) if norm_in else 1, num_warps=4, EXPERT_STRIPS=two_i // BN,
        EXPERT_LATE=ids_late, SILU_OUT=silu_out, aq_ptr=aq, as_ptr=a_s, fp8_max=float(torch.finfo(xq.dtype).max),
        **rank, **trace_args(trace, "w13", n1 // BN * split, dev), **late_dependents((n1, h)), **launch_args(xq, pdl))
    if not silu_out:
        aq, a_s = silu_and_mul_quant_triton(gate_up.view(top_k, two_i), xq.dtype, BK, pdl, early=early)
    norm = residual is not None
    out = torch.empty(1, h, device=dev, dtype=dtype)
    sg = torch.empty_like(out) if norm else out
    ss = torch.empty(BM, h // BN, device=dev, dtype=torch.float32) if norm else out
    shares, w2_stages = _w2_plan(h, inter, top_k, num_sms(dev))
    part = torch.empty(top_k * shares, BM, h, device=dev, dtype=torch.float32)
    if norm:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    res, g = (residual, norm_weight) if norm else (out, out)
    s2 = w2_scale.reshape(e * h // BN, -1)
    tiles = inter // BK // shares
    _fp8_tma_ring_kernel[(h // BN, top_k * shares)](
        _w_desc(w2.view(e * h, inter)), _x_desc(aq), a_s, s2, out, part, tickets(dev), res, g, sg, ss, out, 1, h,
        inter, a_s.stride(0), s2.stride(0), out.stride(0), res.stride(0), sg.stride(0), 1, 0.0, ids, topk_w,
        TILES=tiles, T_PAD=triton.next_power_of_2(tiles), STAGES=min(w2_stages, tiles),
        SPLIT=top_k * shares, NORM_OUT=norm, NORM_IN=False, S_PAD=1, num_warps=4, EXPERT_SHARES=shares,
        fp8_max=float(torch.finfo(torch.float8_e4m3fn).max), **_sg_quant_args(sg_quant, norm), **rank,
        **trace_args(trace, "w2", h // BN * top_k * shares, dev), **late_dependents((h, inter, top_k)),
        **launch_args(aq, pdl))
    return out, sg, ss


def _w2_plan(h: int, inter: int, top_k: int, sms: int) -> tuple[int, int]:
    """(K shares an expert, STAGES) for the experts' ring w2 (fp8_tma_ring_experts): RING_PLANS[(H, I, top_k)]'s
    "SHARES" (default 1; one that does not divide I's tiles counts as 1) and "STAGES", else as many stages as the
    programs an SM then holds leave shared memory for."""
    plan = RING_PLANS.get((h, inter, top_k), {})
    shares = plan.get("SHARES", 1)
    shares = shares if (inter // BK) % shares == 0 else 1
    tiles = inter // BK // shares
    return shares, plan.get("STAGES", _ring_stages(h // BN * top_k * shares, tiles, sms))

"""Decode attention over an e4m3 KV cache on wgmma (Gluon: TMA and wgmma; Hopper), QK^T an fp8 dot.

Why: the Triton decode attention (kernels/triton/attention.py) at 64 sequences is bound by its instructions, a
third of their wait on shared memory: each K and V tile goes global -> shared (fp8) -> registers -> f16 -> the
dot's operand through shared memory again (benchmarks/RESULTS.md). Triton lowers an fp8 dot of 16 rows on sm_90
to bf16 mma.sync with both operands converted, so there is no cheaper K in Triton. Here the K tile goes by TMA
into shared memory and straight into an fp8 wgmma, swapped so that the tile's 64 keys are the wgmma's M side:
S^T [64 keys, HP] = K [64, D] @ q8^T [D, HP] + (the same for q's residual r8): q taken as two e4m3 parts, its
rounding and the rounding of what that leaves, a scale each for the program's q heads (q to about 2^-8 of its
magnitude; e4m3 alone, 2^-4). V still passes through registers once (e4m3 -> f16, stored untransposed into
shared memory: wgmma takes 8-bit operands K-major only, 16-bit ones either way), then O^T [D, HP] += V^T [D, 64]
@ P^T [64, HP] in f16, V^T an MN-major view of that tile.

One program a (sequence, KV head) of a decode batch (one new token a sequence), its q heads (GROUP, padded to HP)
the wgmma's N side. Tiles of 64 keys, four 16-token pages each, each page one TMA box [PAGE, D] of the cache
viewed as [blocks * PAGE, Hk * D]; STAGES tiles in flight; a tile's page ids are loaded together, a refill's at
the top of the iteration that requests it, ahead of its wait. Keys past the context read whatever page 0 holds
and are masked (scores to -inf, V rows to 0). Without ROPE, q is rotated and the new key stored by the launch
ahead: the first STAGES tiles but the one holding the new key are requested before the PDL wait (earlier steps
wrote them). With ROPE, the program normalizes (QK_NORM) and rotates its q heads and its KV head's new key,
stores the key and value, and takes them from registers after the loop: every tile holds earlier keys only, all
requested before the wait.

Gluon has no interpreter: CPU tests compile it for sm_90; its numbers are checked against kernels.attention's
reference on a GPU (tests/kernels/test_attention_wgmma.py).
"""
import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tandem.kernels.triton.device import num_sms
from tandem.kernels.triton.pdl import launch_args

TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton 3.9 / 3.6
CTA_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6
BLOCK_N = gl.constexpr(64)  # keys a tile: the S^T wgmma's M over one warpgroup
HP = gl.constexpr(8)  # a KV head's q heads, padded: the wgmma's N
MAXNREG = 128  # four programs an SM (4 x 128 threads x 128 registers = the register file): one wave at b=64


@gluon.jit
def _tile_pages(bt, tile, ctx, PAGE: gl.constexpr):
    """Tile `tile`'s four page ids (block-table row bt), requested together: one round trip, not one a page
    (each TMA request waits on a CTA barrier, which would put every page id's load latency in series). Pages past
    the context read page 0 (masked by the caller)."""
    gl.static_assert(BLOCK_N == 4 * PAGE)
    b = tile * 4
    return (gl.load(bt + b, mask=b * PAGE < ctx, other=0), gl.load(bt + b + 1, mask=(b + 1) * PAGE < ctx, other=0),
            gl.load(bt + b + 2, mask=(b + 2) * PAGE < ctx, other=0),
            gl.load(bt + b + 3, mask=(b + 3) * PAGE < ctx, other=0))


@gluon.jit
def _issue_tile(k_desc, v_desc, pages, kvh, bar, k_dst, v_dst, PAGE: gl.constexpr, D: gl.constexpr):
    """Request a tile's K and V pages (_tile_pages) into k_dst / v_dst [4 * PAGE, D], on bar."""
    mbarrier.expect(bar, 8 * k_desc.block_type.nbytes)
    for j in gl.static_range(4):
        TMA_LOAD(k_desc, [pages[j] * PAGE, kvh * D], bar, k_dst.slice(j * PAGE, PAGE, dim=0))
        TMA_LOAD(v_desc, [pages[j] * PAGE, kvh * D], bar, v_dst.slice(j * PAGE, PAGE, dim=0))


@gluon.jit
def _norm_rotate(rows, mask, d, partner, cos, sin, w_ptr, eps, NORM: gl.constexpr, D: gl.constexpr):
    """Rows [R, D] at rows + d, RMS-normalized with w (NORM; rounded as rms_norm_ref rounds) and rotated
    NeoX-style, x * cos + x[partner] * sin (sin carries the sign), in float32: kernels/triton/attention.py's
    _norm_rotate in Gluon."""
    x = gl.load(rows + d[None, :], mask=mask, other=0.0).to(gl.float32)
    xp = gl.load(rows + partner[None, :], mask=mask, other=0.0).to(gl.float32)
    if NORM:
        ty: gl.constexpr = rows.dtype.element_ty
        rstd = gl.rsqrt(gl.sum(x * x, axis=1) / D + eps)[:, None]
        w = gl.load(w_ptr + d).to(gl.float32)[None, :]
        wp = gl.load(w_ptr + partner).to(gl.float32)[None, :]
        x = ((x * rstd).to(ty).to(gl.float32) * w).to(ty).to(gl.float32)
        xp = ((xp * rstd).to(ty).to(gl.float32) * wp).to(ty).to(gl.float32)
    return x * cos[None, :] + xp * sin[None, :]


@gluon.jit
def _decode_attention_wgmma_kernel(
    k_desc, v_desc, q_ptr, out_ptr, q8_ptr, q8s_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, pos_ptr, cos_sin_ptr, slot_ptr, qw_ptr, kw_ptr, eps,
    qk_scale, fp8_max, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_q8t, stride_q8st,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    GROUP: gl.constexpr, STAGES: gl.constexpr, KV_MAX: gl.constexpr, QUANT_OUT: gl.constexpr, PDL: gl.constexpr,
    ROPE: gl.constexpr, QK_NORM: gl.constexpr, ROT: gl.constexpr, num_warps: gl.constexpr,
):
    seq = gl.program_id(0)
    kvh = gl.program_id(1)
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    kdt: gl.constexpr = k_desc.dtype
    tok = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    if gl.load(query_start_loc_ptr + seq + 1) == tok:
        return  # a sequence without a token here (graph padding)
    ctx = gl.load(seq_lens_ptr + seq)
    if ROPE:  # the new key and value come from registers (below): the tiles hold the earlier keys only
        n_keys = ctx - 1
    else:
        n_keys = ctx
    n_tiles = (n_keys + BLOCK_N - 1) // BLOCK_N
    bt = block_tables_ptr + seq.to(gl.int64) * stride_bt

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], kdt)
    k_smem = gl.allocate_shared_memory(kdt, [STAGES, BLOCK_N, D], tile_layout)
    v_smem = gl.allocate_shared_memory(kdt, [STAGES, BLOCK_N, D], tile_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    if ROPE:
        n_old = n_tiles
    else:  # the last tile holds the new key, stored by the launch ahead
        n_old = n_tiles - 1
    for i in gl.static_range(STAGES):  # tiles of old keys only (earlier steps wrote them): before the wait
        if i < n_old:
            _issue_tile(k_desc, v_desc, _tile_pages(bt, i, n_keys, PAGE), kvh, bars.index(i), k_smem.index(i),
                        v_smem.index(i), PAGE, D)
    if PDL:  # the launch ahead wrote q (and the new key and value, stored by it or below)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not ROPE:
        last = n_tiles - 1
        if last >= 0 and last < STAGES:  # the tile holding the new key, when it is one of the first STAGES
            _issue_tile(k_desc, v_desc, _tile_pages(bt, last, n_keys, PAGE), kvh, bars.index(last),
                        k_smem.index(last), v_smem.index(last), PAGE, D)

    # q [HP, D] of the program's heads, in e4m3 with one scale (folded into the scores' scale)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    hq = gl.arange(0, HP, layout=gl.SliceLayout(1, ql))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    q_rows = q_ptr + tok * stride_qt + (kvh * GROUP + hq)[:, None] * stride_qh
    q_mask = (hq < GROUP)[:, None] & (dq < D)[None, :]
    if ROPE:  # q and the new key normalized (QK_NORM) and rotated here, the key and value stored
        half: gl.constexpr = ROT // 2
        rot = dq < ROT
        partner = gl.where(rot, gl.where(dq < half, dq + half, dq - half), dq)
        pos = gl.load(pos_ptr + tok).to(gl.int64)
        cos = gl.load(cos_sin_ptr + pos * stride_cs + partner % half, mask=rot, other=1.0).to(gl.float32)
        sin = gl.load(cos_sin_ptr + pos * stride_cs + half + partner % half, mask=rot, other=0.0).to(gl.float32)
        sin = gl.where(dq < half, -sin, sin)
        q = _norm_rotate(q_rows, q_mask, dq, partner, cos, sin, qw_ptr, eps, QK_NORM, D)
        q = q.to(q_ptr.dtype.element_ty).to(gl.float32)  # (as rotary_store_kvcache writes it)
        row = gl.zeros([1, 1], gl.int64, ql)
        k8 = _norm_rotate(k_new_ptr + tok * stride_knt + kvh * stride_knh + row, (dq < D)[None, :], dq, partner, cos,
                          sin, kw_ptr, eps, QK_NORM, D).to(kdt)
        v8 = gl.load(v_new_ptr + tok * stride_vnt + kvh * stride_vnh + row + dq[None, :]).to(kdt)
        slot = gl.load(slot_ptr + tok).to(gl.int64)
        if slot >= 0:  # (the cache is contiguous: a slot's row of KV heads after another's)
            at = slot * (gl.num_programs(1) * D) + kvh * D + row + dq[None, :]
            gl.store(k_cache_ptr + at, k8)
            gl.store(v_cache_ptr + at, v8)
    else:
        q = gl.load(q_rows + dq[None, :], mask=q_mask, other=0.0).to(gl.float32)
    # q as two e4m3 parts, its rounding and the residual's, a scale each for the program's q heads: q to about 2^-8
    # of its magnitude (e4m3 alone: 2^-4), for a second tiny wgmma a tile
    q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), axis=1), axis=0), 1e-30) / KV_MAX
    q8 = (q / q_scale).to(kdt)
    r = q - q8.to(gl.float32) * q_scale
    r_scale = gl.maximum(gl.max(gl.max(gl.abs(r), axis=1), axis=0), 1e-30) / KV_MAX
    q8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, D], kdt)
    q8_smem = gl.allocate_shared_memory(kdt, [HP, D], q8_layout)
    q8_smem.store(q8)
    r8_smem = gl.allocate_shared_memory(kdt, [HP, D], q8_layout)
    r8_smem.store((r / r_scale).to(kdt))
    scale = qk_scale * q_scale
    r_ratio = r_scale / q_scale  # (the residual's scores in units of the rounding's)

    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, HP, 32])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, HP, 16])
    vl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])  # a V tile [BLOCK_N, D]
    vf_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float16))
    pt_smem = gl.allocate_shared_memory(gl.float16, [HP, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([HP, BLOCK_N], gl.float16))
    keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
    keys_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, vl))
    m_i = gl.full([HP], float("-inf"), gl.float32, gl.SliceLayout(0, mma_s))
    l_i = gl.zeros([HP], gl.float32, gl.SliceLayout(0, mma_s))
    acc = gl.zeros([D, HP], gl.float32, mma_o)
    if ROPE:  # the new key's scores (in the tiles' units) and its value, for after the loop
        s_new = gl.convert_layout(gl.sum(q * k8.to(gl.float32), axis=1) / q_scale, gl.SliceLayout(0, mma_s))
        v_new = gl.convert_layout(gl.sum(v8.to(gl.float32), axis=0), gl.SliceLayout(1, mma_o))
    fence_async_shared()
    CTA_BARRIER()  # q's parts are in shared memory before the warpgroup reads them

    for i in range(n_tiles):
        st = i % STAGES
        refill = _tile_pages(bt, i + STAGES, n_keys, PAGE)  # requested now, used once stage st is free
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        s = warpgroup_mma(k_smem.index(st), q8_smem.permute((1, 0)), gl.zeros([BLOCK_N, HP], gl.float32, mma_s),
                          use_acc=False)
        s = s + r_ratio * warpgroup_mma(k_smem.index(st), r8_smem.permute((1, 0)),
                                        gl.zeros([BLOCK_N, HP], gl.float32, mma_s), use_acc=False)
        s = gl.where((i * BLOCK_N + keys_s < n_keys)[:, None], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        p = gl.exp2(s - m_new[None, :])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        v = v_smem.index(st).load(vl).to(gl.float16)
        v = gl.where((i * BLOCK_N + keys_v < n_keys)[:, None], v, 0.0)
        CTA_BARRIER()  # every warp is done with stage st (the wgmma above and the V load) before it is refilled
        if i + STAGES < n_tiles:
            _issue_tile(k_desc, v_desc, refill, kvh, bars.index(st), k_smem.index(st), v_smem.index(st), PAGE, D)
        vf_smem.store(v)
        pt_smem.store(gl.permute(p, (1, 0)).to(gl.float16))
        fence_async_shared()
        CTA_BARRIER()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma_o))[None, :]
        acc = warpgroup_mma(vf_smem.permute((1, 0)), pt_smem.permute((1, 0)), acc)
        CTA_BARRIER()  # the wgmma has read vt and pt before the next tile's stores
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if ROPE:  # the new key, last (an online softmax takes its keys in any order)
        s_new = s_new * scale
        m_new = gl.maximum(m_i, s_new)
        alpha = gl.exp2(m_i - m_new)
        p_new = gl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = (acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma_o))[None, :]
               + v_new[:, None] * gl.convert_layout(p_new, gl.SliceLayout(0, mma_o))[None, :])

    # out[h, :] = acc[:, h] / l[h]
    l_o = gl.convert_layout(l_i, gl.SliceLayout(0, mma_o))
    hs = gl.arange(0, HP, layout=gl.SliceLayout(0, mma_o))
    ds = gl.arange(0, D, layout=gl.SliceLayout(1, mma_o))
    res = (acc / gl.where(l_o == 0.0, 1.0, l_o)[None, :]).to(out_ptr.dtype.element_ty).to(gl.float32)
    head = kvh * GROUP + hs
    mask = (hs < GROUP)[None, :]
    if QUANT_OUT:  # the o projection's fp8 input: one scale a (token, head), as kernels.fp8.quantize_rows
        qs = gl.maximum(gl.max(gl.abs(res), axis=0) / fp8_max, 1e-12)
        q8 = gl.minimum(gl.maximum(res / qs[None, :], -fp8_max), fp8_max).to(q8_ptr.dtype.element_ty)
        gl.store(q8_ptr + tok * stride_q8t + head[None, :] * D + ds[:, None], q8, mask=mask)
        gl.store(q8s_ptr + tok * stride_q8st + head, qs, mask=hs < GROUP)
    else:
        gl.store(out_ptr + tok * stride_ot + head[None, :] * stride_oh + ds[:, None], res.to(out_ptr.dtype.element_ty),
                 mask=mask)


def _cache_desc(cache: torch.Tensor) -> TensorDescriptor:
    """The cache [blocks, PAGE, Hk, D] as [blocks * PAGE, Hk * D], one page of one KV head a box [PAGE, D]."""
    blocks, page, hk, d = cache.shape
    layout = gl.NVMMASharedLayout.get_default_for([page, d], gl.float8e4nv)
    return TensorDescriptor.from_tensor(cache.view(blocks * page, hk * d), [page, d], layout)


def supports(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int | None) -> bool:
    """Whether a launch runs here: a decode batch on an sm_90 GPU over an e4m3fn cache of 16-token pages and
    head_dim 128, at most HP q heads a KV head, whose (sequence, KV head) programs fill the GPU (no split-K here:
    smaller batches keep the Triton kernel's split plans)."""
    return (q.is_cuda and torch.version.cuda is not None and torch.cuda.get_device_capability(q.device)[0] == 9
            and max_query_len == 1 and k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[1] == 16
            and k_cache.shape[3] == 128 and q.shape[1] // k_cache.shape[2] <= HP.value
            and q.shape[0] * k_cache.shape[2] >= num_sms(q.device))


def decode_attention_wgmma(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                           quant: tuple[torch.dtype, int] | None = None, pdl: bool = True, stages: int = 2,
                           rope=None):
    """q: [T, Hq, D] (one token a sequence: query_start_loc = 0..S); caches [blocks, 16, Hk, D] e4m3fn, contiguous.
    Returns [T, Hq, D] in q's dtype, or with quant = (fp8 dtype, D) the o projection's fp8 input (q8 [T, Hq * D],
    scales [T, Hq] float32), as kernels.attention.paged_attention. rope (kernels.attention.NewTokens): q and the
    new keys are raw; each program normalizes (qk_norm) and rotates its q heads and its KV head's new key, stores
    the key and value, and takes them from registers, as rotary_store_kvcache then this launch would (q is not
    written back)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    q8 = torch.empty(num_tokens, num_heads * head_dim, device=q.device, dtype=quant[0]) if quant else out
    q8s = torch.empty(num_tokens, num_heads, device=q.device, dtype=torch.float32) if quant else out
    if rope is not None:
        for t in (q, rope.k, rope.v, rope.cos_sin_cache):
            if t.stride(-1) != 1:
                raise ValueError(f"attention with rope needs a unit stride on the last dim, got strides {t.stride()}")
        q_w, k_w, eps = rope.qk_norm if rope.qk_norm is not None else (q, q, 0.0)  # unused without norm
        rope_ptrs = (rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.slot_mapping, q_w, k_w, eps)
        rope_strides = (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1),
                        rope.cos_sin_cache.stride(0))
    else:
        rope_ptrs, rope_strides = (q, q, q, q, q, q, q, 0.0), (0, 0, 0, 0, 0)
    if num_seqs > 0:
        _decode_attention_wgmma_kernel[(num_seqs, num_kv_heads)](
            _cache_desc(k_cache), _cache_desc(v_cache), q, out, q8, q8s, block_tables, seq_lens, query_start_loc,
            k_cache, v_cache, *rope_ptrs, scale * 1.4426950408889634,
            float(torch.finfo(q8.dtype).max) if quant else 1.0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), q8.stride(0),
            q8s.stride(0), *rope_strides, GROUP=num_heads // num_kv_heads, STAGES=stages,
            KV_MAX=float(torch.finfo(k_cache.dtype).max), QUANT_OUT=quant is not None,
            ROPE=rope is not None, QK_NORM=rope is not None and rope.qk_norm is not None,
            ROT=rope.cos_sin_cache.shape[-1] if rope is not None else 0, num_warps=4, maxnreg=MAXNREG,
            **launch_args(q, pdl))
    return (q8, q8s) if quant else out

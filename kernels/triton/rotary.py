"""NeoX (rotate-half) rotary embedding in Triton, applied to q and k in place.

One program per token reads its cos/sin row once and rotates the first rot_dim features of every
q and k head; features past rot_dim are left as they are.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, c, c_mask, cos, sin,
                  HALF: tl.constexpr, H_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < num_heads) & c_mask[None, :]
    p1 = x_ptr + h * stride_h + c[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    c_mask = c < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    wait_previous(PDL)  # (positions and cos/sin: no kernel of the step writes them)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, c_mask, cos, sin, HALF, HQ_PAD)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c, c_mask, cos, sin, HALF, HK_PAD)


def apply_rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache: [max_pos, rot_dim] = [cos | sin].

    Rotates q and k in place (views such as slices of a fused qkv output are fine) and returns them.
    """
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary needs a unit stride on the last dim of q, k and cos_sin_cache")
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, num_q_heads, num_k_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            HQ_PAD=triton.next_power_of_2(num_q_heads), HK_PAD=triton.next_power_of_2(num_k_heads),
            num_warps=4, **launch_args(q, pdl),
        )
    return q, k


@triton.jit
def _norm_rotate_heads(src_ptr, stride_sh, dst_ptr, stride_dh, num_heads, w_ptr, eps, cos, sin,
                       HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, ROT: tl.constexpr, PASS_PAD: tl.constexpr,
                       H_PAD: tl.constexpr):
    """Loads the heads of one token, RMS-normalizes each over HEAD_DIM (HAS_NORM), rotates the
    first ROT features and writes them to dst (which may be src: each thread writes only the
    elements it read)."""
    h = tl.arange(0, H_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (c < HALF)
    src = src_ptr + h * stride_sh + c
    dst = dst_ptr + h * stride_dh + c
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if PASS_PAD > 0:  # features past ROT: normalized, not rotated
        cp = ROT + tl.arange(0, PASS_PAD)[None, :]
        p_mask = (h < num_heads) & (cp < HEAD_DIM)
        xp = tl.load(src_ptr + h * stride_sh + cp, mask=p_mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # rounded like rms_norm_ref: normalized row to the dtype, then times the weight
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS_PAD > 0:
            ss += tl.sum(xp * xp, axis=1)
        rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        ty = src_ptr.dtype.element_ty
        w1 = tl.load(w_ptr + c, mask=c < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * rstd).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
        if PASS_PAD > 0:
            wp = tl.load(w_ptr + cp, mask=cp < HEAD_DIM, other=0.0).to(tl.float32)
            xp = ((xp * rstd).to(ty).to(tl.float32) * wp).to(ty).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
    if PASS_PAD > 0:
        tl.store(dst_ptr + h * stride_dh + cp, xp.to(out_ty), mask=p_mask)


@triton.jit
def _rotary_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qw_ptr, kw_ptr, eps,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, ROT: tl.constexpr, PASS_PAD: tl.constexpr, PAGE: tl.constexpr,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, ROTATE_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # positions, cos/sin and slots are written by no kernel of the step: read before the wait
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    cos = tl.load(cache_ptr + pos * stride_cache + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    wait_previous(PDL)
    q = q_ptr + t * stride_qt
    _norm_rotate_heads(q, stride_qh, q, stride_qh, num_q_heads, qw_ptr, eps, cos, sin,
                       HAS_NORM, HEAD_DIM, HALF, HALF_PAD, ROT, PASS_PAD, HQ_PAD)
    if slot >= 0:
        block, off = slot // PAGE, slot % PAGE
        _norm_rotate_heads(k_ptr + t * stride_kt, stride_kh,
                           k_cache_ptr + block * stride_kcb + off * stride_kco, stride_kch,
                           num_kv_heads, kw_ptr, eps, cos, sin,
                           HAS_NORM, HEAD_DIM, HALF, HALF_PAD, ROT, PASS_PAD, HK_PAD)
        if ROTATE_K:  # k in place too (it was read above as it was; every thread rewrites what it reads)
            _norm_rotate_heads(k_ptr + t * stride_kt, stride_kh, k_ptr + t * stride_kt, stride_kh,
                               num_kv_heads, kw_ptr, eps, cos, sin,
                               HAS_NORM, HEAD_DIM, HALF, HALF_PAD, ROT, PASS_PAD, HK_PAD)
        h = tl.arange(0, HK_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < num_kv_heads) & (d < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + off * stride_vco + h * stride_vch + d,
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_store_kvcache_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, rotate_k: bool = False, pdl: bool = True,
) -> torch.Tensor:
    """Same contract as kernels.rotary.rotary_store_kvcache_ref, in one launch (a program per
    token). q is normalized and rotated in place; k is normalized and rotated on its way into
    the cache, and in place too when rotate_k (tokens with a slot only); v is copied into the
    cache. Returns q."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    for t in (q, k, v, k_cache, v_cache, cos_sin_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary_store_kvcache needs a unit stride on the last dim, got strides {t.stride()}")
    if num_tokens == 0:
        return q
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unused pointers without norm
    _rotary_store_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_w, k_w, eps,
        num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HAS_NORM=qk_norm is not None, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF=rot // 2, HALF_PAD=triton.next_power_of_2(rot // 2), ROT=rot,
        PASS_PAD=triton.next_power_of_2(head_dim - rot) if head_dim > rot else 0, PAGE=k_cache.shape[1],
        HQ_PAD=triton.next_power_of_2(num_q_heads), HK_PAD=triton.next_power_of_2(num_kv_heads),
        ROTATE_K=rotate_k, num_warps=4, **launch_args(q, pdl),
    )
    return q

"""NeoX (rotate-half) rotary embedding in Triton, applied to q and k in place.

One program per token reads its cos/sin row once and rotates the first rot_dim features of every
q and k head; features past rot_dim are left as they are.
"""
import torch
import triton
import triton.language as tl


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
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    c_mask = c < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, c_mask, cos, sin, HALF, HQ_PAD)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c, c_mask, cos, sin, HALF, HK_PAD)


def apply_rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
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
            num_warps=4,
        )
    return q, k

"""Rotary position embedding, GPT-NeoX style (rotate halves), as in HF Llama/Qwen."""
import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig
from tandem.kernels.kv_cache import store_kvcache_ref
from tandem.kernels.norm import rms_norm_ref


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> torch.Tensor:
    """inv_freq: [rot_dim / 2] -> cache: [max_positions, rot_dim] laid out as [cos | sin] (float32)."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    xr, xpass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = xr.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, xpass], dim=-1) if xpass.numel() else out


def apply_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache: [max_pos, rot_dim].

    Rotates the first rot_dim features of every head; returns new (q, k).
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    config: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as apply_rotary_ref; the Triton path may rotate q and k in place."""
    if use_triton(q):
        from tandem.kernels.triton.rotary import apply_rotary_triton
        return apply_rotary_triton(positions, q, k, cos_sin_cache, config.pdl)
    return apply_rotary_ref(positions, q, k, cos_sin_cache)


def rotary_store_kvcache_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, rotate_k: bool = False,
) -> torch.Tensor:
    """The attention inputs of one layer, ready: positions: [T]; q: [T, Hq, D]; k, v: [T, Hk, D];
    caches: [num_blocks, block_size, Hk, D]; slot_mapping: [T] (negative = not stored).

    qk_norm = (q weight [D], k weight [D], eps) RMS-normalizes every q and k head first (Qwen3).
    Then q and k are rotated and k, v stored in the cache. Returns the rotated q. rotate_k: the
    rotated k of the stored tokens is also written back into k (attention may then read the new
    keys from k instead of the cache).
    """
    k_in = k
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    if rotate_k:
        stored = slot_mapping >= 0
        k_in[stored] = k[stored].to(k_in.dtype)
    return q


def rotary_store_kvcache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, rotate_k: bool = False,
    config: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Same contract as rotary_store_kvcache_ref; the Triton path rotates q in place, in one launch."""
    if use_triton(q):
        from tandem.kernels.triton.rotary import rotary_store_kvcache_triton
        return rotary_store_kvcache_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                           qk_norm, rotate_k, config.pdl)
    return rotary_store_kvcache_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, qk_norm,
                                    rotate_k)

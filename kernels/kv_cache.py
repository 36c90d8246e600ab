"""Storing new keys and values into the paged KV cache.

Layout (shared by every implementation, by attention and by the KV connectors):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot = block_id * block_size + offset_in_block
"""
import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig


def store_kvcache_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hk, D]; slot_mapping: [T] int (negative = padding, not stored)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS,
) -> None:
    if use_triton(key):
        from tandem.kernels.triton.attention import store_kvcache_triton
        return store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping, config.pdl)
    return store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)

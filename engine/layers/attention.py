"""Attention over this layer's slice of the paged KV cache."""
import torch
from torch import nn

from engine.forward_context import ForwardContext
from kernels import paged_attention, store_kvcache


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound to views of the engine's KV cache by the model runner.
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]."""
        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.on_layer_stored is not None:
            ctx.on_layer_stored(self.layer_idx)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, self.scale, ctx.max_query_len, ctx.max_seq_len)
        return out.flatten(1)

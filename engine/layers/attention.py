"""Attention over this layer's slice of the paged KV cache."""
from typing import Callable

import torch
from torch import nn

from tandem.engine.forward_context import ForwardContext
from tandem.kernels import KernelConfig, paged_attention, rotary_store_kvcache, store_kvcache
from tandem.kernels.attention import NewTokens
from tandem.kernels.linear import SplitPartials


class Attention(nn.Module):
    quant_spec: Callable[[torch.Tensor], tuple | None] | None = None  # the FP8 o projection's quant_ahead
    early_spec: Callable[[torch.Tensor], bool] | None = None  # the FP8 o projection's tma_early
    partials_spec: Callable[[torch.Tensor], bool] | None = None  # the FP8 o projection's takes_partials

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 kernels: KernelConfig):
        super().__init__()
        self.kernels = kernels
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound to views of the engine's KV cache by the model runner.
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]. With positions [T] and cos_sin_cache,
        q and k are first RMS-normalized per head (qk_norm = (q weight, k weight, eps)) and rotated,
        in the launch that stores k and v (one kernel for what took up to four), or in the
        attention launch itself (a decode batch on the GPU, kernels.attention.NewTokens)."""
        # a fresh prefill's keys are all in k, v: the GPU kernel reads them there, not through the cache
        dense = ctx.prefills_from_start and ctx.max_query_len > 1 and q.is_cuda
        rope = None
        if cos_sin_cache is None:
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.kernels)
        elif dense or ctx.on_layer_stored is not None:  # (the hook reads the stored layer)
            q = rotary_store_kvcache(positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache,
                                     ctx.slot_mapping, qk_norm, rotate_k=dense, config=self.kernels)
        else:
            rope = NewTokens(positions, k, v, cos_sin_cache, ctx.slot_mapping, qk_norm)
        if ctx.on_layer_stored is not None:
            ctx.on_layer_stored(self.layer_idx)
        quant = self.quant_out(q)  # (with partials: where the launch does not split)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, self.scale, ctx.max_query_len, ctx.max_seq_len,
                              (k, v) if dense else None, rope, self.kernels, quant, early=self.early_out(q),
                              partials=self.partials_out(q))
        return out if quant or isinstance(out, SplitPartials) else out.flatten(1)

    def _out_rows(self, q: torch.Tensor) -> torch.Tensor:
        """An empty stand-in [T, Hq * D] of this step's output rows (shape, dtype and device only), as the o
        projection's specs take them."""
        return q.new_empty(()).expand(q.shape[0], self.num_heads * self.head_dim)

    def early_out(self, q: torch.Tensor) -> bool:
        """Whether this step's split merge lets the o projection's launch in before its own PDL wait (the FP8
        o projection's tma_early, linked as early_spec by engine/layers/fp8.py)."""
        return self.early_spec is not None and self.early_spec(self._out_rows(q))

    def partials_out(self, q: torch.Tensor) -> bool:
        """Whether this step hands the o projection its split-K partials where the launch splits K (the FP8 o
        projection's takes_partials, linked as partials_spec by engine/layers/fp8.py)."""
        return self.partials_spec is not None and self.partials_spec(self._out_rows(q))

    def quant_out(self, q: torch.Tensor) -> tuple | None:
        """(fp8 dtype, head_dim) where the FP8 o projection after takes this step's output [T, Hq * D]
        quantized (its quant_ahead, linked as quant_spec by engine/layers/fp8.py; a group of its K
        block must be one head), else None."""
        if self.quant_spec is None:
            return None
        spec = self.quant_spec(self._out_rows(q))
        return spec if spec is not None and spec[1] == self.head_dim else None

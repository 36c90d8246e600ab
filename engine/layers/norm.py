"""RMSNorm layers, and the handoff that lets the RMSNorms of a decoder layer ride on the GEMMs
around them.

At decode sizes on a GPU (KernelConfig.fuse_norms) an RMSNorm between two GEMMs costs no launch of
its own: the GEMM ahead (o_proj, down_proj, the MoE experts) adds the residual and leaves the norm
pending (kernels.linear.PendingNorm: the rows times the norm weight and their sums of squares),
and the GEMM after (qkv, gate_up, the MoE router and experts) scales its output by each row's
1/rms. The model code does not see it: the GEMM ahead returns a `DeferredOutput` instead of its
output, a `PendingRMSNorm` asks it to add the residual and leave the norm pending (or computes it
and runs the norm as usual), and the linear and MoE layers take a `PendingNorm` as their input.

Where the norms run on their own ahead of an FP8 GEMM that would quantize its input in a launch of
its own (17-64 rows, KernelConfig.fuse_fp8_quant), the norm writes that input quantized instead
(kernels.fp8.QuantRows), as the attention and the MLP activation do: engine/layers/fp8.py links
each such producer to the FP8 layer after it (`quant_spec`).
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tandem.kernels import KernelConfig, fused_add_rms_norm, rms_norm
from tandem.kernels.fp8 import rms_norm_quant
from tandem.kernels.linear import PendingNorm


@dataclass
class DeferredOutput:
    """A layer's output whose last GEMM waits for the RMSNorm after it. compute() runs it as is ->
    [T, H]; add_norm(residual [T, H], norm) runs it with the residual added and `norm` left pending
    -> PendingNorm, or returns None (and runs nothing) where that does not apply."""
    compute: Callable[[], torch.Tensor]
    add_norm: Callable[[torch.Tensor, "RMSNorm"], PendingNorm | None]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, kernels: KernelConfig):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | DeferredOutput, residual: torch.Tensor | None = None):
        """x: [T, H]. Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if isinstance(x, DeferredOutput):
            x = x.compute()
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.kernels)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.kernels)


def next_quant(norm: RMSNorm, rows: torch.Tensor) -> tuple[torch.dtype, int] | None:
    """The (dtype, group) in which the FP8 layer after `norm` (a PendingRMSNorm linked to it by
    engine/layers/fp8.py) would quantize rows shaped as `rows` in a launch of its own, for the GEMM ahead
    that leaves `norm` pending to write them quantized instead (KernelConfig.fp8_sg_quant); None where
    nothing is linked or it would not."""
    spec = getattr(norm, "quant_spec", None)
    return spec(rows) if spec is not None else None


def next_router(norm: RMSNorm, rows: torch.Tensor) -> tuple | None:
    """(router weight, (dtype, group)) where the ring experts after `norm` (linked by engine/layers/fp8.py) would
    take their router GEMM in partials and their row quantized from the GEMM ahead that leaves `norm` pending
    (kernels.fp8.fold_router), else None."""
    spec = getattr(norm, "router_spec", None)
    return spec(rows) if spec is not None else None


class PendingRMSNorm(RMSNorm):
    """An RMSNorm between two GEMMs (a decoder layer's input and post-attention norms): when the
    layer ahead deferred its output and can carry the add and the norm, returns (PendingNorm,
    the new residual) for the next linear or MoE layer to apply; else what RMSNorm returns."""

    quant_spec: Callable[[torch.Tensor], tuple | None] | None = None  # the FP8 layer after's quant_ahead
    router_spec: Callable[[torch.Tensor], tuple | None] | None = None  # the FP8 MoE after's router_ahead

    def forward(self, x: torch.Tensor | DeferredOutput, residual: torch.Tensor | None = None):
        if isinstance(x, DeferredOutput) and residual is not None:
            pending = x.add_norm(residual, self)
            if pending is not None:
                return pending, pending.s
        if self.quant_spec is not None:
            x = x.compute() if isinstance(x, DeferredOutput) else x
            spec = self.quant_spec(x)
            if spec is not None:
                rows, summed = rms_norm_quant(x, residual, self.weight, self.eps, *spec, self.kernels)
                return rows if residual is None else (rows, summed)
        return super().forward(x, residual)

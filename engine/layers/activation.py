"""The gated MLP activation as a layer."""
from typing import Callable

import torch
from torch import nn

from tandem.kernels import KernelConfig, silu_and_mul
from tandem.kernels.fp8 import QuantRows, silu_and_mul_quant


class SiluAndMul(nn.Module):
    """[..., 2 * d] laid out as [gate | up] -> silu(gate) * up, [..., d]; quantized for the FP8 layer
    after (kernels.fp8.QuantRows) where engine/layers/fp8.py linked one and it takes such rows."""

    quant_spec: Callable[[torch.Tensor], tuple | None] | None = None

    def __init__(self, *, kernels: KernelConfig):
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantRows:
        if self.quant_spec is not None:
            spec = self.quant_spec(x[..., :x.shape[-1] // 2])
            if spec is not None:
                return silu_and_mul_quant(x, *spec, self.kernels)
        return silu_and_mul(x, self.kernels)

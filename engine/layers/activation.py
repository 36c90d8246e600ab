"""The gated MLP activation as a layer."""
import torch
from torch import nn

from tandem.kernels import KernelConfig, silu_and_mul


class SiluAndMul(nn.Module):
    """[..., 2 * d] laid out as [gate | up] -> silu(gate) * up, [..., d]."""

    def __init__(self, *, kernels: KernelConfig):
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.kernels)

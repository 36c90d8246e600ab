"""SiLU(gate) * up, the gated MLP activation."""
import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] laid out as [gate | up] -> [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    if use_triton(x):
        from tandem.kernels.triton.activation import silu_and_mul_triton
        return silu_and_mul_triton(x, config.pdl)
    return silu_and_mul_ref(x)

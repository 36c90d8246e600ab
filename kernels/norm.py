"""RMSNorm, alone and fused with the residual add."""
import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden]. Computed in float32, returned in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    if use_triton(x):
        from tandem.kernels.triton.norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, config.pdl)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    config: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from tandem.kernels.triton.norm import fused_add_rms_norm_triton
        return fused_add_rms_norm_triton(x, residual, weight, eps, config.pdl)
    return fused_add_rms_norm_ref(x, residual, weight, eps)

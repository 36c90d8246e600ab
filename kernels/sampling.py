"""Row argmax for sampling: torch's, or one Triton launch on a GPU (kernels/triton/argmax.py)."""
import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig


def argmax(x: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x: [N, V] float -> [N] int64 (torch.argmax(x, dim=-1): first maximum, NaN above all)."""
    if use_triton(x) and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0:
        from tandem.kernels.triton.argmax import argmax_triton
        return argmax_triton(x, config.pdl)
    return x.argmax(dim=-1)

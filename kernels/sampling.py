"""Row argmax for sampling: torch's, or one Triton launch on a GPU (kernels/triton/argmax.py)."""
import torch

from tandem.kernels.backend import use_triton

# H100, Llama-3-8B shape, batch 1: -0.027 ms a decode step against torch.argmax over the 128k
# vocabulary (benchmarks/RESULTS.md, A/B of decode variants; benchmarks/ab_decode.py switches it)
TRITON_ARGMAX = True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] float -> [N] int64 (torch.argmax(x, dim=-1): first maximum, NaN above all)."""
    if TRITON_ARGMAX and use_triton(x) and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0:
        from tandem.kernels.triton.argmax import argmax_triton
        return argmax_triton(x)
    return x.argmax(dim=-1)

"""Row argmax for sampling: torch's, or one Triton launch on a GPU (kernels/triton/argmax.py)."""
import torch

from kernels.backend import use_triton

# Off until measured on a GPU (benchmarks/ab_decode.py switches it): torch.argmax over a 128k
# vocabulary takes 27 us on an H100 (benchmarks/RESULTS.md, sixth round).
TRITON_ARGMAX = False


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] float -> [N] int64 (torch.argmax(x, dim=-1): first maximum, NaN above all)."""
    if TRITON_ARGMAX and use_triton(x) and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0:
        from kernels.triton.argmax import argmax_triton
        return argmax_triton(x)
    return x.argmax(dim=-1)

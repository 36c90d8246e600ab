"""The matmul of linear layers: torch (cuBLAS, hipBLASLt, CPU) in general, and a Triton GEMM for
decode-sized batches on a GPU (kernels/triton/linear.py), which is launched like our other
kernels (programmatic dependent launch) instead of waiting for the kernel ahead to end."""
import torch
import torch.nn.functional as F

from kernels.backend import use_triton

_skinny = True


def set_skinny(enabled: bool) -> None:
    """Use the Triton GEMM for decode-sized batches (default) or torch always (benchmarks)."""
    global _skinny
    _skinny = enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]."""
    if _skinny and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        from kernels.triton.linear import MAX_ROWS, skinny_linear_triton
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= MAX_ROWS:
            y = skinny_linear_triton(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)

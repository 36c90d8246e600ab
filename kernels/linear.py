"""The matmul of linear layers: torch (cuBLAS, hipBLASLt, CPU) in general, and a Triton GEMM for
decode-sized batches on a GPU (kernels/triton/linear.py), which is launched like our other
kernels (programmatic dependent launch) instead of waiting for the kernel ahead to end."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.backend import use_triton
from tandem.kernels.norm import rms_norm

_skinny = True
# the RMSNorms of a decoder layer carried by the GEMM ahead and the GEMM after (linear_add_norm,
# linear_normed) instead of launches of their own; FOLD_INPUT_NORM: the input norm too (the MLP
# of the layer ahead carries it), not only the post-attention one. benchmarks/ab_decode.py
# switches both
FOLD_NORM = True
FOLD_INPUT_NORM = True


def set_skinny(enabled: bool) -> None:
    """Use the Triton GEMM for decode-sized batches (default) or torch always (benchmarks)."""
    global _skinny
    _skinny = enabled


def _decode_rows(x: torch.Tensor) -> int:
    """x's row count where the Triton GEMM takes x as its input (a GPU, <= 16 rows of bf16/fp16), else 0."""
    if not (_skinny and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)):
        return 0
    from tandem.kernels.triton.linear import MAX_ROWS
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows if rows <= MAX_ROWS else 0


def _skinny_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """x's row count where the Triton GEMM takes this matmul, else 0."""
    return _decode_rows(x) if weight.dtype == x.dtype else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]."""
    rows = _skinny_rows(x, weight)
    if rows:
        from tandem.kernels.triton.linear import skinny_linear_triton
        y = skinny_linear_triton(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


@dataclass
class PendingNorm:
    """rms_norm(s) with `weight`, left for the next decode GEMM to apply (linear_normed): s is the
    residual stream, sg = s * weight (rounded) and ss [16, strips] float32 each strip's sums of
    squares of s's rows (kernels/triton/linear.py, NORM_OUT / NORM_IN)."""
    s: torch.Tensor
    sg: torch.Tensor
    ss: torch.Tensor
    weight: torch.Tensor
    eps: float

    def normed(self) -> torch.Tensor:
        """rms_norm(s), for a consumer that cannot apply the pending norm itself."""
        return rms_norm(self.s, self.weight, self.eps)


def linear_add_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
) -> PendingNorm | None:
    """x @ weight.T + residual, with the RMSNorm after it left pending: at decode sizes on a GPU
    (FOLD_NORM on), one launch of the Triton GEMM; else None, and the caller runs `linear` and the
    norm. x: [T, K]; weight: [N, K]; residual: [T, N]; norm_weight: [N]."""
    if not (can_pend(x) and weight.dtype == norm_weight.dtype == residual.dtype == x.dtype):
        return None
    from tandem.kernels.triton.linear import skinny_linear_add_norm_triton
    s, sg, ss = skinny_linear_add_norm_triton(x, weight, residual, norm_weight)
    return PendingNorm(s, sg, ss, norm_weight, eps)


def linear_normed(p: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(p.s) @ weight.T + bias: the Triton GEMM on p.sg, scaled by each row's 1/rms in
    its epilogue (no norm launch)."""
    if not _skinny_rows(p.sg, weight):
        return linear(p.normed(), weight, bias)
    from tandem.kernels.triton.linear import skinny_linear_normed_triton
    y = skinny_linear_normed_triton(p.sg, weight, p.ss, p.eps)
    return y if bias is None else y + bias


def can_pend(x: torch.Tensor) -> bool:
    """Whether kernels on x's rows may leave an RMSNorm pending (FOLD_NORM, a GPU, decode sizes)."""
    return FOLD_NORM and x.dim() == 2 and _decode_rows(x) > 0

"""The matmul of linear layers: torch (cuBLAS, hipBLASLt, CPU) in general, and a Triton GEMM for
decode-sized batches on a GPU (kernels/triton/linear.py), which is launched like our other
kernels (programmatic dependent launch) instead of waiting for the kernel ahead to end."""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig
from tandem.kernels.norm import rms_norm


def decode_rows(x: torch.Tensor, config: KernelConfig) -> int:
    """x's row count where the Triton GEMM takes x as its input (config.skinny_gemm, a GPU, <= 16
    rows of bf16/fp16), else 0."""
    if not (config.skinny_gemm and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)):
        return 0
    from tandem.kernels.triton.linear import MAX_ROWS
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows if rows <= MAX_ROWS else 0


def _skinny_rows(x: torch.Tensor, weight: torch.Tensor, config: KernelConfig) -> int:
    """x's row count where the Triton GEMM takes this matmul, else 0."""
    return decode_rows(x, config) if weight.dtype == x.dtype else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]."""
    rows = _skinny_rows(x, weight, config)
    if rows:
        from tandem.kernels.triton.linear import skinny_linear_triton
        y = skinny_linear_triton(x.reshape(rows, x.shape[-1]), weight, pdl=config.pdl).view(
            *x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


@dataclass
class SplitPartials:
    """A decode step's attention output left as its split-K partials, for a consumer that merges them itself (the
    FP8 o projection's TMA GEMM at one token, kernels/triton/fp8_tma.py MERGE): acc [T, Hq, S, D] and ml [T, Hq, S,
    2] (running max in log2 units, sum) float32, seq_lens [num_seqs], block_n the launch's key tile (with S and
    seq_lens it gives the splits that have keys); merged() runs the split merge instead and returns what the
    attention would have ([T, Hq * D] in dtype, or with quant its quantized rows)."""
    acc: torch.Tensor
    ml: torch.Tensor
    seq_lens: torch.Tensor
    block_n: int
    dtype: torch.dtype
    merged: Callable[[], object]

    @property
    def rows(self) -> torch.Tensor:
        """An empty stand-in [T, Hq * D] of the merged rows (shape, dtype and device only)."""
        t, hq, _, d = self.acc.shape
        return self.acc.new_empty((), dtype=self.dtype).expand(t, hq * d)


@dataclass
class PendingNorm:
    """rms_norm(s) with `weight`, left for the next decode GEMM to apply (linear_normed): s is the
    residual stream, sg = s * weight (rounded) and ss [16, strips] float32 each strip's sums of
    squares of s's rows (kernels/triton/linear.py, NORM_OUT / NORM_IN). quant: sg quantized for the next FP8
    GEMM (kernels.fp8.QuantRows), where the GEMM that left the norm pending wrote that too (fp8_sg_quant). router:
    the MoE router GEMM after, on sg, left in float32 partial sums over strips of 128 columns by that GEMM too
    (KernelConfig.fp8_tma_ring_moe_fold), with quant the row for the ring experts' w13."""
    s: torch.Tensor
    sg: torch.Tensor
    ss: torch.Tensor
    weight: torch.Tensor
    eps: float
    quant: object = None  # kernels.fp8.QuantRows (which imports this module) or None
    router: torch.Tensor | None = None  # the next router GEMM's partials [strips, E] (kernels.fp8.fp8_linear_add_norm)

    def normed(self, config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """rms_norm(s), for a consumer that cannot apply the pending norm itself."""
        return rms_norm(self.s, self.weight, self.eps, config)


def linear_add_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    config: KernelConfig = DEFAULT_KERNELS,
) -> PendingNorm | None:
    """x @ weight.T + residual, with the RMSNorm after it left pending: at decode sizes on a GPU
    (config.fuse_norms), one launch of the Triton GEMM; else None, and the caller runs `linear`
    and the norm. x: [T, K]; weight: [N, K]; residual: [T, N]; norm_weight: [N]."""
    if not (can_pend(x, config) and weight.dtype == norm_weight.dtype == residual.dtype == x.dtype):
        return None
    from tandem.kernels.triton.linear import skinny_linear_add_norm_triton
    s, sg, ss = skinny_linear_add_norm_triton(x, weight, residual, norm_weight, pdl=config.pdl)
    return PendingNorm(s, sg, ss, norm_weight, eps)


def linear_normed(p: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """rms_norm(p.s) @ weight.T + bias: the Triton GEMM on p.sg, scaled by each row's 1/rms in
    its epilogue (no norm launch)."""
    if not _skinny_rows(p.sg, weight, config):
        return linear(p.normed(config), weight, bias, config)
    from tandem.kernels.triton.linear import skinny_linear_normed_triton
    y = skinny_linear_normed_triton(p.sg, weight, p.ss, p.eps, pdl=config.pdl)
    return y if bias is None else y + bias


def can_pend(x: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether kernels on x's rows may leave an RMSNorm pending (config.fuse_norms, a GPU, decode sizes)."""
    return config.fuse_norms and x.dim() == 2 and decode_rows(x, config) > 0

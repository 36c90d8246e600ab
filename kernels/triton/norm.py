"""RMSNorm and fused residual-add + RMSNorm in Triton: one program per row, one pass over it.

Rounding follows the torch reference: the normalised row is rounded to the input dtype before
the weight multiply, and the fused variant normalises the rounded sum it returns.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
    stride_x, stride_res, stride_out, stride_sum,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with a unit stride on hidden (a copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, res, weight, out, s, eps, pdl):
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rms_norm_kernel[(n_rows,)](
        x, res, weight, out, s, n_cols, eps,
        x.stride(0), res.stride(0), out.stride(0), s.stride(0),
        HAS_RESIDUAL=res is not x, BLOCK=block, num_warps=warps, **launch_args(x, pdl),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> [..., hidden] (dtype as the reference's promotion)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.result_type(x, weight))
    _launch(x2, x2, weight, out, x2, eps, pdl)
    return out.view(x.shape)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., hidden] -> (rms_norm(x + residual), x + residual); inputs untouched."""
    x2, r2 = _rows(x), _rows(residual)
    s = torch.empty(x2.shape, device=x.device, dtype=torch.result_type(x, residual))
    out = torch.empty(x2.shape, device=x.device, dtype=torch.result_type(s, weight))
    _launch(x2, r2, weight, out, s, eps, pdl)
    return out.view(x.shape), s.view(x.shape)

"""RMSNorm and fused residual-add + RMSNorm in Triton: one program per row, one pass over it.

Rounding follows the torch reference: the normalised row is rounded to the input dtype before
the weight multiply, and the fused variant normalises the rounded sum it returns.

QUANT_GROUP (> 0): instead of the normed row, its FP8 quantization for the FP8 GEMM after
(kernels.fp8.quantize_rows of the row rounded to the output dtype: the same values the separate
quantization launch would write), q in fp8 and one float32 scale per group of QUANT_GROUP columns.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.fp8_skinny import _quant_tile
from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
    stride_x, stride_res, stride_out, stride_sum, q_ptr, qs_ptr, stride_q, stride_qs, fp8_max,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr,
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
    if QUANT_GROUP:
        _store_quantized(y.to(out_ptr.dtype.element_ty).to(tl.float32), q_ptr + row * stride_q,
                         qs_ptr + row * stride_qs, 0, n_cols, fp8_max, BLOCK, QUANT_GROUP)
    else:
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized(y, q_row, s_row, col0, n_cols, fp8_max, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """y [BLOCK] float32, columns col0.. of a row -> q_row[col] (fp8) and s_row[group] float32, per
    group of GROUP columns (BLOCK and col0 multiples of GROUP; columns past n_cols are not stored and
    must be 0 in y): kernels.fp8.quantize_rows."""
    groups: tl.constexpr = BLOCK // GROUP
    g = tl.reshape(y, [groups, GROUP])
    cols = col0 + tl.arange(0, groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    q, s = _quant_tile(g, fp8_max, q_row.dtype.element_ty)
    gi = col0 // GROUP + tl.arange(0, groups)
    tl.store(s_row + gi, s, mask=gi * GROUP < n_cols)
    tl.store(q_row + cols, q, mask=cols < n_cols)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with a unit stride on hidden (a copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, res, weight, out, s, eps, pdl, quant=None):
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    q, qs, group = quant or (out, out, 0)
    block = max(triton.next_power_of_2(n_cols), group)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rms_norm_kernel[(n_rows,)](
        x, res, weight, out, s, n_cols, eps,
        x.stride(0), res.stride(0), out.stride(0), s.stride(0), q, qs, q.stride(0), qs.stride(0),
        float(torch.finfo(q.dtype).max) if quant else 1.0,
        HAS_RESIDUAL=res is not x, BLOCK=block, QUANT_GROUP=group, num_warps=warps, **launch_args(x, pdl),
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


def rms_norm_quant_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype, group: int,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """kernels.fp8.rms_norm_quant_ref on the GPU, one launch. x, residual: [T, H] -> (q [T, H] dtype,
    s [T, ceil(H / group)] float32, x + residual or None); group a power of two."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(sum_dtype, weight.dtype)  # the normed row's, rounded to before quantizing
    q = torch.empty(x2.shape, device=x.device, dtype=dtype)
    qs = torch.empty(n_rows, triton.cdiv(n_cols, group), device=x.device, dtype=torch.float32)
    out = torch.empty(0, device=x.device, dtype=out_dtype)  # dtype only: QUANT_GROUP stores no row
    if residual is None:
        _launch(x2, x2, weight, out, x2, eps, pdl, (q, qs, group))
        return q, qs, None
    r2 = _rows(residual)
    s = torch.empty(x2.shape, device=x.device, dtype=sum_dtype)
    _launch(x2, r2, weight, out, s, eps, pdl, (q, qs, group))
    return q, qs, s.view(x.shape)

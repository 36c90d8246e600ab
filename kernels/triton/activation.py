"""SiLU(gate) * up in Triton, [..., 2d] laid out as [gate | up] -> [..., d]."""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.norm import _store_quantized
from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, q_ptr, qs_ptr, stride_q, stride_qs, fp8_max,
                         BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False):
    wait_previous(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # round silu(gate) to the output dtype first, as the torch reference does
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (act * up).to(out_ptr.dtype.element_ty)
    if QUANT_GROUP:  # the FP8 GEMM's input instead (kernels/triton/norm.py's _store_quantized)
        _store_quantized(y.to(tl.float32), q_ptr + row * stride_q, qs_ptr + row * stride_qs,
                         tl.program_id(1) * BLOCK, d, fp8_max, BLOCK, QUANT_GROUP)
    else:
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x: [..., 2 * d] -> [..., d] in x.dtype."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, device=x.device, dtype=x.dtype)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), out.stride(0), out, out, 0, 0, 1.0, BLOCK=block, QUANT_GROUP=0, num_warps=4,
            **launch_args(x2, pdl))
    return out.view(*x.shape[:-1], d)


def silu_and_mul_quant_triton(x: torch.Tensor, dtype: torch.dtype, group: int,
                              pdl: bool = True, early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.fp8.silu_and_mul_quant_ref on the GPU, one launch: x [T, 2 * d] -> (q [T, d] dtype,
    s [T, ceil(d / group)] float32); group a power of two <= 1024. early: the next launch let in before this
    one's PDL wait (kernels/triton/pdl.py)."""
    d = x.shape[-1] // 2
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(x2.shape[0], d, device=x.device, dtype=dtype)
    qs = torch.empty(x2.shape[0], triton.cdiv(d, group), device=x.device, dtype=torch.float32)
    if x2.shape[0] and d:
        block = max(group, min(1024, triton.next_power_of_2(d)))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, torch.empty(0, device=x.device, dtype=x.dtype), d, x2.stride(0), 0, q, qs, q.stride(0),
            qs.stride(0), float(torch.finfo(dtype).max), BLOCK=block, QUANT_GROUP=group, EARLY=early, num_warps=4,
            **launch_args(x2, pdl))
    return q, qs

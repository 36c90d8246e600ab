"""Activations sent as float8_e4m3fn with one float32 scale per token (row).

A packed row is [H] e4m3 bytes followed by the 4 bytes of its scale, as uint8: one tensor to
send (collectives need not know the fp8 dtype; gloo does not)."""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H] -> [T, H + 4] uint8: x / s in e4m3, then s (float32), s = max|row| / 448."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale).to(FP8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed: [R, H + 4] uint8 from quantize_rows -> [R, H] in dtype."""
    hidden = packed.shape[1] - 4
    scale = packed[:, hidden:].contiguous().view(torch.float32)
    return (packed[:, :hidden].view(FP8).float() * scale).to(dtype)

"""The skip the FP8 GPU tests share: they need a CUDA/ROCm GPU with FP8 compute (Hopper and
newer, MI300)."""
import pytest
import torch


def fp8_gpu_dtype() -> torch.dtype:
    """The platform's e4m3 dtype (e4m3fnuz on MI300); skips the test without a GPU with FP8."""
    from tandem.kernels.fp8 import fp8_dtype, has_fp8_compute

    if not torch.cuda.is_available() or not has_fp8_compute(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8")
    return fp8_dtype("cuda")


def hopper_block_case(m: int, n: int, k: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TMA / wgmma kernels' case (skips without an NVIDIA GPU of compute capability 9.0+): a random
    block-scaled (128, 128) e4m3 weight [n, k] with its scales and bf16 rows x [m, k], and the generator
    that made them (seeded 0) for anything more the test draws."""
    if not torch.cuda.is_available() or torch.version.cuda is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs TMA and wgmma (compute capability 9.0+)")
    from tandem.kernels.fp8 import quantize_weight
    g = torch.Generator(device="cuda").manual_seed(0)
    w, ws = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05,
                            block=(128, 128))
    return g, w, ws, torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)


def assert_codes_match(got: torch.Tensor, ref: torch.Tensor, rare: float = 1e-5) -> None:
    """fp8 codes a kernel wrote against torch's (kernels.fp8.quantize_rows) of the same values: equal, save a rare
    few (at most max(2, rare * numel)) one code apart with the same sign. Triton's float32 `x / s` compiles to
    div.full.f32 (within 2 ulp) where torch divides in IEEE float32, so a quotient within 2 ulp of a rounding
    midpoint between two codes may take the neighbouring one; a wrong scale, rounding mode or element moves far
    more codes, or further."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
    g, r = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    off = g != r
    n = int(off.sum())
    assert n <= max(2, rare * g.numel()), f"{n} of {g.numel()} codes differ"
    g, r = g[off], r[off]
    assert torch.equal(g & 0x80, r & 0x80) and bool(((g & 0x7F) - (r & 0x7F)).abs().le(1).all()), (g, r)

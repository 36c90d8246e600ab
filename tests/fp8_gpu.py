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

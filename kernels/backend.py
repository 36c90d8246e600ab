"""Which implementation a kernel call uses: Triton on a GPU tensor, torch otherwise."""
import functools
import importlib

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def rocm_package_available(package: str) -> bool:
    """torch is a ROCm build and `package` (a ROCm-only library: aiter, mori) imports."""
    if torch.version.hip is None:
        return False
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def require_rocm_package(package: str, feature: str, instead: str) -> None:
    """Raise a clear ValueError unless `feature` (which needs `package`) can run here."""
    if torch.version.hip is None:
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
        raise ValueError(f"{feature} needs ROCm (this torch is built for {built}); use {instead}")
    try:
        importlib.import_module(package)
    except ImportError as exc:
        raise ValueError(f"{feature} needs the {package!r} package, which failed to import ({exc}); "
                         f"use {instead}") from exc

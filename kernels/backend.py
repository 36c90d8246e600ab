"""Which implementation a kernel call uses: Triton on a GPU tensor, torch otherwise."""
import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


_force_reference = False


def force_reference(enabled: bool) -> None:
    """Make every dispatcher use the torch reference (tests, debugging)."""
    global _force_reference
    _force_reference = enabled


def use_triton(t: torch.Tensor) -> bool:
    return not _force_reference and t.is_cuda and triton_available()

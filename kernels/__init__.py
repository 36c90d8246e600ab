"""Compute kernels behind small Python functions.

Each public function picks an implementation by device: Triton on CUDA/ROCm
(when importable), the plain-torch reference otherwise. References live next to
the dispatchers and are what the tests compare the fast paths against.
This package imports nothing else of Tandem's. Its names load on first use: the API process
reads KernelConfig (through the engine's config) and must not pay torch's import for it.
"""
import importlib

_HOMES = {"silu_and_mul": "activation", "paged_attention": "attention", "KernelConfig": "config",
          "store_kvcache": "kv_cache", "fused_add_rms_norm": "norm", "rms_norm": "norm", "apply_rotary": "rotary",
          "build_cos_sin_cache": "rotary", "rotary_store_kvcache": "rotary"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)

__all__ = [
    "apply_rotary",
    "KernelConfig",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_store_kvcache",
    "silu_and_mul",
    "store_kvcache",
]

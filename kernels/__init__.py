"""Compute kernels behind small Python functions.

Each public function picks an implementation by device: Triton on CUDA/ROCm
(when importable), the plain-torch reference otherwise. References live next to
the dispatchers and are what the tests compare the fast paths against.
This package imports nothing else of Tandem's.
"""
from tandem.kernels.activation import silu_and_mul
from tandem.kernels.attention import paged_attention
from tandem.kernels.config import KernelConfig
from tandem.kernels.kv_cache import store_kvcache
from tandem.kernels.norm import fused_add_rms_norm, rms_norm
from tandem.kernels.rotary import apply_rotary, build_cos_sin_cache, rotary_store_kvcache

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

"""Triton kernels (CUDA and ROCm), each behind a small function in kernels/."""

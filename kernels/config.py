"""KernelConfig: the kernel and decode-path choices, one frozen dataclass.

The engine holds one inside its EngineConfig (`EngineConfig.kernel`, one flag per field) and hands
it to every layer at construction; the layers pass it to the kernel functions here, whose default
is `KernelConfig()` (tests and benchmarks that call a kernel directly). Each field is a choice that
is on by default because it measured faster (benchmarks/RESULTS.md); turning one off gives the
plainer path, for profiling, A/B runs (benchmarks/ab_decode.py) or ruling a fusion out when
numbers look wrong. No module-level switch decides a path.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelConfig:
    pdl: bool = field(default=True, metadata={"help": (
        "launch our Triton kernels with programmatic dependent launch (CUDA, compute capability 9.0 "
        "and up): each kernel is resident before the one ahead ends; --no-pdl: each waits for its launch")})
    skinny_gemm: bool = field(default=True, metadata={"help": (
        "decode-sized linear layers (<= 16 rows of bf16/fp16 on a GPU) on our Triton GEMM; "
        "--no-skinny-gemm: torch's matmul (cuBLAS/hipBLASLt) at every size")})
    fuse_norms: bool = field(default=True, metadata={"help": (
        "at decode sizes on a GPU, each RMSNorm between two GEMMs rides on them (the GEMM ahead adds the "
        "residual and sums squares, the GEMM after scales by 1/rms) instead of a launch of its own")})
    fuse_rope: bool = field(default=True, metadata={"help": (
        "a decode batch's q/k norm, rotary embedding and KV-cache store done by the attention launch "
        "(GPU) instead of a launch of their own")})


DEFAULT_KERNELS = KernelConfig()

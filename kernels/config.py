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
    attention_kv_early: bool = field(default=True, metadata={"help": (
        "with --fuse-rope, in a split-K decode attention over an fp8 cache (a batch of one or two), each program "
        "reads its last K/V tile before its PDL wait (an earlier step wrote it) and puts the new key and value into "
        "it from registers, so that tile's latency overlaps the GEMM ahead")})
    fp8_int_convert: bool = field(default=True, metadata={"help": (
        "kernels reading e4m3 into bf16 (an fp8 KV cache in attention, the W8A16 GEMMs) convert with integer "
        "ops (CUDA); --no-fp8-int-convert: Triton's cvt conversion, which runs on the GPU's slow conversion units")})
    fp8_kv_f16: bool = field(default=True, metadata={"help": (
        "attention over an fp8 KV cache (CUDA, bf16 models) reads e4m3 into f16, one cvt instruction a pair "
        "of values, and runs its dots in f16, q taken to f16; --no-fp8-kv-f16: bf16 dots, K and V read as "
        "--fp8-int-convert says")})
    fp8_attention_wgmma: bool = field(default=False, metadata={"help": (
        "decode batches over an e4m3 KV cache on Hopper run kernels/triton/attention_wgmma.py: K by TMA straight "
        "into fp8 wgmmas (q as two e4m3 parts, its rounding and the residual's), V once through registers "
        "into an f16 wgmma; with --fuse-rope it also normalizes and rotates q and the new key and stores the key and "
        "value (the new key taken from registers), else those run in a launch of their own ahead of it")})
    fp8_moe_w8a16: bool = field(default=True, metadata={"help": (
        "at decode sizes (<= 16 tokens on a GPU with FP8, every expert here) FP8 experts run on the routed "
        "bf16 expert kernels reading the fp8 weights (W8A16: routing in the first GEMM, no activation "
        "quantization, the norms fused as for bf16); --no-fp8-moe-w8a16: routing, then the FP8 grouped GEMMs")})
    fuse_fp8_quant: bool = field(default=True, metadata={"help": (
        "at 17-64 rows, where the FP8 decode GEMM quantizes its input in a launch of its own, the RMSNorm, "
        "attention (a scale group of one head) or SiLU-and-mul ahead of it writes that input in fp8 with its "
        "scales instead (block-scaled weights)")})
    fp8_dense_w8a16: bool = field(default=False, metadata={"help": (
        "at decode sizes (<= 16 rows on a GPU with FP8) FP8 linear layers read their weights into the bf16 "
        "skinny GEMM (W8A16) instead of the FP8 decode GEMM (W8A8; faster on the Llama-3-8B step, "
        "benchmarks/RESULTS.md)")})
    fp8_tma_gemm: bool = field(default=True, metadata={"help": (
        "at decode sizes (<= 16 rows, NVIDIA compute capability 9.0 and up) an FP8 o projection of 12 MiB or more "
        "(block-scaled (128, 128), ahead of the post-attention norm; Llama-3-8B's) runs on the Gluon GEMM that "
        "requests all of its weight into shared memory by TMA before its PDL wait (kernels/triton/fp8_tma.py); "
        "--no-fp8-tma-gemm: the Triton decode GEMM")})
    fp8_tma_early: bool = field(default=True, metadata={"help": (
        "the attention's split merge lets that o projection in before its own PDL wait, so the o weight streams "
        "while the attention runs (kernels.fp8.tma_early)")})
    fp8_tma_merge: bool = field(default=True, metadata={"help": (
        "at one token, where that o projection's TMA GEMM runs, the attention hands it its split-K partials and each "
        "GEMM program merges its heads itself, so no merge launch runs between them")})
    fp8_tma_ring: bool = field(default=True, metadata={"help": (
        "at 1 row (a batch-1 decode step; compute capability 9.0 and up) an FP8 linear layer the o projection's TMA "
        "GEMM does not take gets its input written quantized by the kernel ahead (the SiLU-and-mul ahead of "
        "down_proj, the attention ahead of a smaller o_proj) and runs on the Gluon GEMM's ring form: its weight "
        "through shared-memory stages by TMA, the first stages requested before its PDL wait "
        "(kernels/triton/fp8_tma.py; block-scaled (128, 128))")})
    fp8_tma_ring_normed: bool = field(default=True, metadata={"help": (
        "the same ring form for an FP8 layer after a pending norm (qkv_proj, the dense gate_up_proj), its input "
        "quantized by a launch ahead")})
    fp8_tma_ring_early: bool = field(default=True, metadata={"help": (
        "the kernel writing the ring form's quantized input (the SiLU-and-mul; the quantization after a pending "
        "norm) lets the ring GEMM in before its own PDL wait, so its first weight stages stream during the tail "
        "of the GEMM ahead")})
    fp8_tma_ring_moe: bool = field(default=True, metadata={"help": (
        "one token's routed FP8 experts (a batch-1 decode step, every expert here; compute capability 9.0 and up; "
        "block-scaled (128, 128)) on the ring form instead of the W8A16 expert kernels: a routing launch, the "
        "row quantized, w13 over the top-k experts' strips side by side, the SiLU-and-mul quantizing, w2 with a "
        "K share an expert (kernels/triton/fp8_tma.py fp8_tma_ring_experts)")})
    fp8_tma_ring_moe_route: bool = field(default=True, metadata={"help": (
        "those ring experts' router GEMM (a bf16 router weight), top-k and row quantization in one launch "
        "(kernels/triton/routing.py route_token_triton) instead of three")})
    fp8_tma_ring_moe_rank: bool = field(default=True, metadata={"help": (
        "with fp8_tma_ring_moe_route: the routing launch writes the router logits only, and every program of the "
        "experts' w13 and w2 ranks them itself for its expert, so no ticket and second read of the logits sit "
        "between the router GEMM and w13's first weight copy")})
    fp8_tma_ring_moe_silu: bool = field(default=True, metadata={"help": (
        "those ring experts' w13 writes the SiLU-and-mul of each gate and up strip, quantized for w2, itself (the "
        "last of their programs, a ticket) instead of gate_up for a launch of its own")})
    fp8_tma_ring_moe_fused: bool = field(default=False, metadata={"help": (
        "with fp8_tma_ring_moe_rank at softmax scoring: those ring experts' w13 and w2 as one persistent launch, "
        "each program's w13 tiles then its w2 tiles through one ring, a w2 item waiting only for its pair's "
        "activation (kernels/triton/fp8_tma_moe.py); its programs wait on one another, so the GPU must not be "
        "shared with other work; off until measured")})
    fp8_sg_quant: bool = field(default=True, metadata={"help": (
        "at 1 row, a Gluon decode GEMM that leaves the next RMSNorm pending (the TMA o projection, a ring down_proj, "
        "the ring experts' w2) also writes the pending norm's input quantized where the next FP8 GEMM is on the "
        "ring form, so no quantization launch runs between them")})
    fp8_tma_ring_moe_fold: bool = field(default=False, metadata={"help": (
        "with fp8_tma_ring_moe_rank and fp8_sg_quant, at 1 row: the TMA o projection ahead of the ring experts "
        "(leaving the post-attention norm pending) also writes each strip's share of the router GEMM and the "
        "row quantized, and w13's and w2's programs sum the shares and rank them, so no routing launch runs "
        "(kernels/triton/fp8_tma.py ROUTER, R_STRIPS); off: on an H100 the Qwen3-30B-A3B b=1 step went from "
        "2.098-2.101 to 2.170-2.177 ms (benchmarks/RESULTS.md)")})

DEFAULT_KERNELS = KernelConfig()

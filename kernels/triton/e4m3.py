"""e4m3 -> bf16 in integer ops, for kernels that read fp8 (the W8A16 GEMMs, an fp8 KV cache).

Triton's `.to(tl.bfloat16)` of an e4m3 tile compiles to cvt e4m3x2 -> f16x2, then f16 -> bf16 per
value, on the GPU's conversion units; at decode sizes those, not HBM, bounded the W8A16 expert
GEMMs (benchmarks/RESULTS.md). e4m3's sign, 4 exponent and 3 mantissa bits placed into bf16's
sign, low exponent and high mantissa bits read as the value times 2^(7 - 127), subnormals as
subnormals, exactly: two byte permutes, then and/shift/lop3 twice, per 4 values. A kernel using
it scales its float32 result back by E4M3_BF16_UNIT once.

Where the other operand can be f16 (attention: q, and the softmax weights), e4m3_to_f16 is cheaper
still: e4m3 is a subset of f16, and cvt.rn.f16x2.e4m3x2 converts two values in one instruction
(sm_89 and up), with no rescaling.
"""
import torch
import triton
import triton.language as tl

E4M3_BF16_UNIT = tl.constexpr(2.0 ** 120)  # e4m3_to_bf16_scaled's tiles hold w / E4M3_BF16_UNIT


def fast_cvt(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a kernel multiplying bf16 x by e4m3 w converts w with e4m3_to_bf16_scaled (CUDA PTX;
    ROCm and the interpreter keep `.to()`)."""
    return (x.is_cuda and torch.version.cuda is not None and x.dtype == torch.bfloat16
            and w.dtype == torch.float8_e4m3fn)


_ASM = tl.constexpr("""{
        .reg .b32 z, a, b, t;
        mov.b32 z, 0;
        prmt.b32 a, $2, z, 0x1404;
        prmt.b32 b, $2, z, 0x3424;
        and.b32 t, a, 0x7F007F00;
        shr.b32 t, t, 4;
        lop3.b32 $0, a, 0x80008000, t, 0xea;
        and.b32 t, b, 0x7F007F00;
        shr.b32 t, t, 4;
        lop3.b32 $1, b, 0x80008000, t, 0xea;
        }""")


@triton.jit
def e4m3_to_bf16_scaled(w, PINNED: tl.constexpr = False):
    """An e4m3 tile as bf16 holding w / E4M3_BF16_UNIT (module docstring).

    PINNED: marked impure, so that Triton's layout pass cannot move the conversion behind a later
    conversion of its result to a dot operand's layout, and it stays in the layout w was loaded in.
    For an attention V tile (keys, the dot's reduction dim, are rows) the moved form reads the fp8
    bytes from shared memory one by one (LDS.U8 in sm_90 SASS); pinned, the tile is converted from
    16-byte reads and reaches the dot as bf16 through ldmatrix.trans."""
    # (two calls: `is_pure=not PINNED` does not compile, create_inline_asm wants a plain bool)
    if PINNED:
        out = tl.inline_asm_elementwise(asm=_ASM, constraints="=r,=r,r", args=[w.to(tl.uint8, bitcast=True)],
                                        dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        out = tl.inline_asm_elementwise(asm=_ASM, constraints="=r,=r,r", args=[w.to(tl.uint8, bitcast=True)],
                                        dtype=tl.bfloat16, is_pure=True, pack=4)
    return out


_F16_ASM = tl.constexpr("""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""")


@triton.jit
def e4m3_to_f16(w, PINNED: tl.constexpr = False):
    """An e4m3 tile as f16, exactly (every e4m3 value is an f16). Unpinned it is Triton's own
    conversion (the same cvt); PINNED keeps it in the layout w was loaded in, as
    e4m3_to_bf16_scaled's PINNED does."""
    if PINNED:
        out = tl.inline_asm_elementwise(asm=_F16_ASM, constraints="=r,=r,r", args=[w.to(tl.uint8, bitcast=True)],
                                        dtype=tl.float16, is_pure=False, pack=4)
    else:
        out = w.to(tl.float16)
    return out

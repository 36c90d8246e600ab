"""The FP8 grouped expert GEMM (kernels/triton/fp8.py _fp8_grouped_gemm_kernel) compiles for sm_90
without a GPU, for the tile plans benchmarks/fp8_moe.py sweeps and moe_config picks at decode.

Found here (Triton 3.9): at BLOCK_M 16 the fp8 dot lowers to mma.sync on f16 after an in-register
e4m3 -> f16 conversion (wgmma needs 64-row tiles), so BLOCK_N 16 is the narrowest tile that fills
an mma (8 compiles, with the same mma count as 16); every sweep tile (BLOCK_N 16-128, 1-4 warps,
2-5 stages) fits in an H100's shared memory with pipelined (cp.async) loads.
"""
import pytest

from tests.kernels.test_fp8 import SMEM_LIMIT, _compile_sm90

PTRS = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", sorted_ptr="*i32",
            block_expert_ptr="*i32", block_rows_ptr="*i32", topk_w_ptr="*fp32")
# (BLOCK_N, num_warps, num_stages): the narrow tiles at both ends of warps and stages, the widest
# tile at the most stages (the most shared memory), and the default decode plan
PLANS = [(16, 1, 2), (16, 2, 5), (32, 1, 5), (32, 4, 2), (128, 2, 5), (64, 4, 4)]


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("gated", [True, False], ids=["w13", "w2"])
def test_fp8_moe_plans_compile_for_sm90(gated, per_channel):
    from benchmarks.fp8_moe import gemm_candidates
    from tandem.kernels.triton.fp8 import _fp8_grouped_gemm_kernel, moe_config, moe_gemm_meta
    default = moe_gemm_meta(moe_config(8, 128, None if per_channel else 128), 1 if gated else 2,
                            None if per_channel else 128)
    assert (default["BLOCK_N"], default["num_warps"], default["num_stages"]) == PLANS[-1]
    assert set(PLANS) <= set(gemm_candidates())  # what is compiled here is what the sweep tries
    for bn, warps, stages in PLANS:
        consts = dict(TOP_K=8, GATHER_A=gated, SCATTER_OUT=not gated, GATED=gated, BLOCK_M=16, BLOCK_N=bn,
                      BLOCK_K=128, PER_CHANNEL=per_channel, EVEN_K=True)
        compiled = _compile_sm90(_fp8_grouped_gemm_kernel, PTRS, consts, warps, stages)
        ptx, what = compiled.asm["ptx"], (bn, warps, stages)
        assert "e4m3" in ptx and ("wgmma" in ptx or "mma.sync" in ptx), what
        assert "cp.async" in ptx, what
        assert compiled.metadata.shared <= SMEM_LIMIT, (what, compiled.metadata.shared)

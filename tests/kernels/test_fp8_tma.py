"""kernels/triton/fp8_tma.py, the Gluon FP8 decode GEMM with its weight in shared memory before the PDL wait, and
the split merge that lets it in early (KernelConfig.fp8_tma_gemm, fp8_tma_early).

CPU: the grid rule, and the sm_90 compile: every weight tile a TMA copy before the wait, wgmma, the split-K
ticket only with a split; the merge's launch_dependents before its wait only with EARLY. GPU: the kernel against
kernels.fp8's reference (dequantize, then matmul), the pending norm's outputs against torch on that reference.
(Gluon has no interpreter: its numbers are checked on a GPU only.)"""
import pytest
import torch

from tests.fp8_gpu import hopper_block_case

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")


def test_split_rule():
    """A program an SM at the fewest K shares, at most MAX_TILES tiles a program, one wave of shared memory."""
    from tandem.kernels.triton.fp8_tma import MAX_TILES, split_for
    assert split_for(4096, 4096, 132) == 8  # Llama-3-8B o: 32 strips x 8 shares of 4 tiles
    assert split_for(2048, 4096, 132) == 16  # Qwen3-30B-A3B o: 16 strips x 16 shares of 2 tiles
    assert split_for(256, 256, 132) == 2  # a tile a program where the strips are few
    assert split_for(4096, 14336, 132) is None  # 512 programs of 7 tiles: more than one wave fits
    assert split_for(512, 384, 132) is None  # 3 tiles: no power-of-two share
    assert all(4096 // 128 // split_for(n, 4096, 132) <= MAX_TILES for n in (128, 1024, 4096))


def test_early_only_where_the_o_weight_outlasts_the_merge(monkeypatch):
    """kernels.fp8: the o projection takes the TMA GEMM, and the merge lets it in early, on such a GPU (stood in
    for here: CPU) with a weight of 12 MiB or more (Llama-3-8B's o, 16 MiB), not Qwen3-30B-A3B's (8 MiB); neither
    with fp8_tma_gemm off, no early launch with fp8_tma_early off; the attention of a decoder layer asks its FP8 o
    projection (engine/layers/fp8.py links them)."""
    from torch import nn

    from tandem.engine.layers.attention import Attention
    from tandem.engine.layers.fp8 import link_quantized_inputs, quantize_layers
    from tandem.engine.layers.linear import RowParallelLinear
    from tandem.engine.quantization import Fp8Scheme
    from tandem.kernels import KernelConfig, fp8
    monkeypatch.setattr(fp8, "_tma_device", lambda x: True)
    x = torch.empty(1, 4096, dtype=torch.bfloat16)
    big, small = (torch.empty(n, 4096, dtype=fp8.E4M3) for n in (4096, 2048))
    on = KernelConfig()
    assert fp8._tma_gemm(x, big, (128, 128), on) and fp8.tma_early(x, big, (128, 128))
    assert not fp8._tma_gemm(x, small, (128, 128), on) and not fp8.tma_early(x, small, (128, 128))
    assert not fp8._tma_gemm(x, big, (1, 128), on)  # a scale a row: not the kernel's (128, 128) blocks
    assert fp8._tma_gemm(x, big, (128, 128), KernelConfig(fp8_tma_early=False))
    assert not fp8.tma_early(x, big, (128, 128), KernelConfig(fp8_tma_early=False))
    off = KernelConfig(fp8_tma_gemm=False)
    assert not fp8._tma_gemm(x, big, (128, 128), off) and not fp8.tma_early(x, big, (128, 128), off)
    layer = nn.Module()
    layer.attn = Attention(0, 32, 8, 128, 1.0, kernels=KernelConfig())
    layer.o_proj = RowParallelLinear(4096, 4096, kernels=KernelConfig(), norm_after=True)
    quantize_layers(layer, Fp8Scheme((128, 128), "weight_scale_inv"))
    layer.o_proj.weight_scale_inv.data.fill_(1.0)  # (one scale a block: folded into (128, 128) blocks)
    layer.o_proj.process_weights_after_loading()
    link_quantized_inputs(layer)
    assert layer.attn.early_spec.__self__ is layer.o_proj
    assert layer.attn.early_out(torch.empty(1, 32, 128, dtype=torch.bfloat16))


def _compile(tiles: int, split: int, norm: bool, pdl: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tandem.kernels.triton.fp8_tma import _fp8_tma_kernel, _w_desc
    w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    ptrs = dict(x_ptr="*bf16", ws_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", ticket_ptr="*i32", res_ptr="*bf16",
                g_ptr="*bf16", sg_ptr="*bf16", ss_ptr="*fp32")
    ints = ("M", "N", "stride_xm", "stride_ws", "stride_om", "stride_rm", "stride_gm")
    consts = dict(TILES=tiles, SPLIT=split, NORM_OUT=norm, PDL=pdl, num_warps=4)
    sig = {"w_desc": _w_desc(w).__mangle__(), **ptrs, **{n: "i32" for n in ints}, "fp8_max": "fp32",
           **{n: "constexpr" for n in consts}}
    return triton.compile(GluonASTSource(_fp8_tma_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


@pytest.mark.parametrize("tiles,split,norm", [(4, 8, True), (2, 16, False), (1, 1, True)])
def test_compiles_with_every_weight_tile_before_the_wait(tiles, split, norm):
    compiled = _compile(tiles, split, norm, pdl=True)
    ptx = compiled.asm["ptx"]
    copies = [i for i in range(len(ptx)) if ptx.startswith("cp.async.bulk.tensor", i)]
    assert len(copies) == tiles and copies[-1] < ptx.index("griddepcontrol.wait")  # all of the weight, ahead
    assert ptx.count("wgmma.mma_async") == tiles * 8  # m64 n16 k32: 2 x 4 a 128 x 128 tile
    assert ("atom.global" in ptx or "atom.acq_rel" in ptx) == (split > 1)  # the split-K ticket
    assert compiled.metadata.shared <= 227 * 1024
    assert "griddepcontrol" not in _compile(tiles, split, norm, pdl=False).asm["ptx"]


@pytest.mark.parametrize("early", [False, True])
def test_merge_lets_the_next_launch_in_before_its_wait_only_when_early(early):
    from tandem.kernels.triton.attention import _merge_splits_kernel
    from tests.kernels.test_fp8 import _compile_sm90
    consts = dict(NUM_SPLITS=64, D_PAD=128, BLOCK_Q=4, BLOCK_N=128, PDL=True, QUANT_OUT=False, EARLY=early)
    ptx = _compile_sm90(_merge_splits_kernel, dict(out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32",
                                                   query_start_loc_ptr="*i32", seq_lens_ptr="*i32", q8_ptr="*fp8e4nv",
                                                   q8s_ptr="*fp32", fp8_max="fp32"), consts, 4, 1).asm["ptx"]
    first = ptx.index("griddepcontrol.launch_dependents")
    assert (first < ptx.index("griddepcontrol.wait")) == early


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 4096), (256, 256)])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_reference_gpu(m, n, k, norm):
    g, w, ws, x = hopper_block_case(m, n, k)
    from tandem.kernels.fp8 import fp8_linear_ref
    from tandem.kernels.triton.fp8_tma import fp8_tma_linear, supports
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    gamma = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    assert supports(x, w, (128, 128))
    ref = fp8_linear_ref(x, w, ws, (128, 128))
    for pdl in (False, True):  # twice each: the tickets are back to zero after a launch
        out, sg, ss = fp8_tma_linear(x, w, ws, res if norm else None, gamma if norm else None, pdl=pdl)
        want = (ref.float() + res.float()).to(torch.bfloat16) if norm else ref
        assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
        if norm:
            sf = out.float()
            assert torch.allclose(sg.float(), (sf * gamma.float()).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
            assert ss.shape == (16, n // 128) and not ss[m:].any()
            assert torch.allclose(ss[:m].sum(1), (sf * sf).sum(1), rtol=1e-3)
    from tandem.kernels.triton.device import tickets
    assert not tickets(x.device).any()

"""kernels/triton/fp8_tma_moe.py, one token's routed FP8 experts as one persistent launch
(KernelConfig.fp8_tma_ring_moe_fused).

CPU: the plan rule, and the sm_90 compile: one PDL wait ahead of every weight copy (the ranking picks the rows),
the top-k rounds as warp maxes, shared memory within an SM's. GPU: the launch against the two-launch ring form on
the same inputs and against the FP8 experts' reference, with and without the pending norms, at the rule's plan and
at others (two programs an SM, w2 in two K shares); the tickets and the pairs' counters back at zero after it.
(Gluon has no interpreter: its numbers are checked on a GPU only.)"""
import pytest
import torch

from tests.fp8_gpu import hopper_block_case

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")


def _at(ptx: str, what: str) -> list[int]:
    return [i for i in range(len(ptx)) if ptx.startswith(what, i)]


def test_plan_rule(monkeypatch):
    """Qwen3-30B-A3B's experts (hidden 2048, 768 an expert, top 8) on 132 SMs: w13 in 384 items of 4 tiles, w2 in
    128 of 6, the longest program 18 tiles (3 w13 items and a w2 item), 11 stages in an SM's shared memory; a
    FUSED_PLANS entry overrides the rule, a K split that does not divide the tiles falls back."""
    from tandem.kernels.triton import fp8_tma_moe
    from tandem.kernels.triton.fp8_tma import BK, BM, BN, SMEM_PER_SM
    plan = fp8_tma_moe.fused_plan(2048, 768, 8, 132)
    assert plan == {"SPLIT": 4, "SHARES": 1, "PER_SM": 1, "STAGES": 11, "PROGS": 132, "TILES": 18}
    assert plan["STAGES"] * (BN * BK + BM * BK) + 6 * BM * BK <= SMEM_PER_SM
    monkeypatch.setitem(fp8_tma_moe.FUSED_PLANS, (2048, 768, 8), {"PER_SM": 2, "SHARES": 2, "SPLIT": 32})
    plan = fp8_tma_moe.fused_plan(2048, 768, 8, 132)
    # 16 K tiles: SPLIT 32 halves to 16 (1536 w13 items of a tile: 6 for the first 216 of 264 programs); w2 in 256
    # items of 3 tiles; half an SM's shared memory a program
    assert (plan["SPLIT"], plan["SHARES"], plan["PROGS"]) == (16, 2, 264)
    assert plan["TILES"] == 6 * 1 + 3 and plan["STAGES"] == 5
    assert fp8_tma_moe.fused_supports(2048, 768, 8, 128) and not fp8_tma_moe.fused_supports(2048, 700, 8, 128)


def _compile(plan: dict, norm_in: bool, norm_out: bool, quant_sg: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tandem.kernels.triton.fp8_tma_moe import _fp8_tma_moe_kernel
    w = torch.empty(4096, 2048, dtype=torch.float8_e4m3fn)
    x = torch.empty(1, 2048, dtype=torch.float8_e4m3fn)
    w_desc = TensorDescriptor.from_tensor(w, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128],
                                                                                                gl.float8e4nv))
    x_desc = TensorDescriptor.from_tensor(x, [16, 128], gl.NVMMASharedLayout.get_default_for([16, 128], gl.float8e4nv))
    ptrs = dict(xs_ptr="*fp32", s13_ptr="*fp32", s2_ptr="*fp32", logits_ptr="*fp32", num_experts="i32",
                part13_ptr="*fp32", aq_ptr="*fp8e4nv", as_ptr="*fp32", part2_ptr="*fp32", ticket_ptr="*i32",
                out_ptr="*bf16", res_ptr="*bf16", g_ptr="*bf16", sg_ptr="*bf16", ss_ptr="*fp32", ss_in_ptr="*fp32",
                in_strips="i32", eps="fp32", stride_s13="i32", stride_s2="i32", stride_rm="i32", stride_gm="i32",
                fp8_max="fp32", sq_ptr="*fp8e4nv", sqs_ptr="*fp32", trace_ptr="*i64")
    consts = dict(H=2048, I=768, PROGS=plan["PROGS"], SPLIT13=plan["SPLIT"], SHARES=plan["SHARES"],
                  STAGES=plan["STAGES"], TV_PAD=triton.next_power_of_2(plan["TILES"]), E_PAD=128, TOP_K=8, K_PAD=8,
                  RENORMALIZE=True, NORM_IN=norm_in, S_PAD=16, NORM_OUT=norm_out, QUANT_SG=quant_sg, PDL=True,
                  TRACE=False, num_warps=4)
    sig = {"w13_desc": w_desc.__mangle__(), "w2_desc": w_desc.__mangle__(), "x_desc": x_desc.__mangle__(), **ptrs,
           **{n: "constexpr" for n in consts}}
    return triton.compile(GluonASTSource(_fp8_tma_moe_kernel, sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


@pytest.mark.parametrize("norm_in,norm_out,quant_sg", [(True, True, True), (False, False, False)])
def test_compiles_ranking_ahead_of_every_weight_copy(norm_in, norm_out, quant_sg):
    """Qwen3-30B-A3B's plan compiles for sm_90: the one PDL wait ahead of the logits' load and of every weight copy
    (the ranking picks their rows), eight rounds of one 32-bit warp max (the top 8 on the logits' codes, all slots
    at once), and the shared memory the plan counted, one program an SM."""
    from tandem.kernels.triton.fp8_tma import SMEM_PER_SM
    from tandem.kernels.triton.fp8_tma_moe import fused_plan
    compiled = _compile(fused_plan(2048, 768, 8, 132), norm_in, norm_out, quant_sg)
    ptx = compiled.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert wait < min(_at(ptx, "ld.global")) and wait < min(_at(ptx, "cp.async.bulk.tensor"))
    assert ptx.count("redux.sync.max.s32") == 8
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx
    assert SMEM_PER_SM // 2 < compiled.metadata.shared <= SMEM_PER_SM


def _experts_case(e: int, h: int, inter: int):
    g, _, _, _ = hopper_block_case(1, 128, 128)
    from tandem.kernels.fp8 import quantize_weight
    dev = "cuda"
    w13, s13 = quantize_weight(torch.randn(e * 2 * inter, h, device=dev, generator=g) * 0.05, block=(128, 128))
    w2, s2 = quantize_weight(torch.randn(e * h, inter, device=dev, generator=g) * 0.05, block=(128, 128))
    w13, s13, w2, s2 = (t.view(e, -1, t.shape[-1]) for t in (w13, s13, w2, s2))
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16, generator=g)
    gate = (torch.randn(e, h, device=dev, generator=g) / h**0.5).to(torch.bfloat16)
    return g, w13, s13, w2, s2, x, gate


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,inter,top_k", [(128, 2048, 768, 8), (16, 2048, 768, 8), (8, 256, 256, 2)])
@pytest.mark.parametrize("mode", ["plain", "norm_in", "norm_out"])
@pytest.mark.parametrize("plan", [{}, {"PER_SM": 2, "SHARES": 2}, {"SPLIT": 2, "STAGES": 4}])
def test_fused_matches_the_ring_and_the_reference_gpu(e, h, inter, top_k, mode, plan, monkeypatch):
    """kernels.moe.routed_experts for one token with the router GEMM ahead (route_token_triton's logits, ranked by
    the experts' programs) as one fused launch, against the two-launch ring form (within 5e-3: w13's K split
    differs) and the FP8 experts' reference (routing in torch on the bf16 logits); with the pending norm's
    consumer side (1/rms exactly 1/2) and producer side (+ the residual, sg, ss, and sg quantized for the next GEMM
    as quantize_rows_triton would, bit for bit); twice (equal bit for bit: the counters are back at zero), the tickets zero after."""
    from tandem.kernels import KernelConfig
    from tandem.kernels.fp8 import E4M3, fused_experts_fp8_ref, ring_experts, ring_router
    from tandem.kernels.moe import routed_experts, topk_routing_ref
    from tandem.kernels.triton import fp8_tma_moe
    from tandem.kernels.triton.device import tickets
    from tandem.kernels.triton.fp8_skinny import quantize_rows_triton
    monkeypatch.setitem(fp8_tma_moe.FUSED_PLANS, (h, inter, top_k), plan)
    g, w13, s13, w2, s2, x, gate = _experts_case(e, h, inter)
    scales = (s13, s2, (128, 128))
    fused, ring = KernelConfig(fp8_tma_ring_moe_fused=True), KernelConfig()
    assert ring_experts(x, w13, w2, scales, top_k) and ring_router(x, gate, fused)
    kw, x_ref, rstd = {}, x, 1.0
    if mode == "norm_in":
        ss = torch.zeros(16, h // 128, device="cuda")
        ss[0] = 4 * 128 * torch.rand(h // 128, device="cuda", generator=g).softmax(0) * (h // 128)
        kw, x_ref, rstd = dict(norm_in=(ss, 0.0)), x * 0.5, 0.5
    res = torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    gamma = torch.randn(h, device="cuda", dtype=torch.bfloat16, generator=g)
    if mode == "norm_out":
        kw = dict(norm_out=(res, gamma), quant=(E4M3, 128))
    logits = ((x.float() @ gate.float().t()) * rstd).to(torch.bfloat16)
    weights, ids = topk_routing_ref(logits, top_k, True, "softmax")
    ref = fused_experts_fp8_ref(x_ref, w13, s13, w2, s2, weights, ids, (128, 128)).float()
    if mode == "norm_out":
        ref = (ref + res.float()).to(torch.bfloat16).float()
    calls = []
    launch = fp8_tma_moe.fp8_tma_fused_experts
    monkeypatch.setattr(fp8_tma_moe, "fp8_tma_fused_experts", lambda *a, **k: calls.append(1) or launch(*a, **k))
    got = [routed_experts(x, None, w13, w2, top_k, True, scales=scales, config=c, gate=gate, **kw)
           for c in (fused, fused, ring)]
    assert len(calls) == 2
    outs = [o[0] if mode == "norm_out" else o for o in got]
    # (w13's sums in another K split round gate and up to bf16 apart in a few places, as the ring's own SiLU forms)
    assert ((outs[0].float() - outs[2].float()).norm() / outs[2].float().norm()).item() < 5e-3
    assert ((outs[0].float() - ref).norm() / ref.norm()).item() < 2e-2
    assert torch.equal(outs[0], outs[1])
    if mode == "norm_out":
        s, sg, ss, rows = got[0]
        sf = s.float()
        assert torch.equal(sg, (sf * gamma.float()).to(torch.bfloat16))
        assert ss.shape == (16, h // 128) and torch.allclose(ss[0].sum(), (sf * sf).sum(), rtol=1e-3)
        q, qs = quantize_rows_triton(sg, E4M3, 128)
        assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.s, qs)
        assert torch.equal(got[1][1], sg) and torch.equal(got[1][3].q.view(torch.uint8), q.view(torch.uint8))
    assert not tickets(x.device).any()

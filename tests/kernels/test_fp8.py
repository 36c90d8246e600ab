"""FP8 kernels against their torch references (kernels/fp8.py).

- CPU: the references themselves (quantization round trips; fp8_linear_ref against a float32
  matmul of the dequantized weights; fp8 experts against the bf16 experts reference on the
  dequantized weights).
- Triton interpreter (CPU, one child process; Triton 3.9's interpreter handles fp8 loads and dots):
  the FP8 GEMM (per-channel and block, skinny and prefill tiles) and the fp8 fused experts against
  fp8_linear_ref / fused_experts_fp8_ref. The interpreter's float32 -> e4m3 cast misrounds values
  whose rounding carries into the exponent (125.7 -> 64, not 128), so there the activations are
  quantized by the torch reference and the quantization kernel is checked only loosely; on a GPU
  the kernels quantize and the quantization must match the reference exactly.
- GPU (`-m gpu`): the same on CUDA/ROCm with the platform's fp8 dtype, plus the FP8 KV cache in
  paged attention against paged_attention_ref on the same fp8 cache.
"""
import json

import pytest
import torch

from tandem.kernels.fp8 import (E4M3, dequantize_weight, fp8_linear_ref, fused_experts_fp8_ref, quantize_rows,
                                quantize_weight)
from tandem.kernels.moe import fused_experts_ref
from tests.fp8_gpu import fp8_gpu_dtype
from tests.interpreter import run_under_interpreter


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("block", [None, (128, 128), (32, 64)])
def test_weight_quantization_round_trip(block):
    w = torch.randn(200, 300) * 0.05
    q, s = quantize_weight(w, E4M3, block)
    assert q.dtype == E4M3 and s.shape == ((200,) if block is None else (-(-200 // block[0]), -(-300 // block[1])))
    assert _rel(dequantize_weight(q, s, block), w) < 0.04  # e4m3: 3 mantissa bits


def test_row_quantization_groups():
    x = torch.randn(5, 300)
    x[2, 130:] *= 100  # a row whose second group is far larger: per-group scales keep its first group exact-ish
    q, s = quantize_rows(x, E4M3, 128)
    assert s.shape == (5, 3)
    deq = q.float() * s.repeat_interleave(128, 1)[:, :300]
    assert _rel(deq[2, :128], x[2, :128]) < 0.04 and _rel(deq, x) < 0.04


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_linear_ref_close_to_float(block):
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    w = torch.randn(96, 256) * 0.05
    q, s = quantize_weight(w, E4M3, block)
    ref = x.float() @ dequantize_weight(q, s, block).t()
    assert _rel(fp8_linear_ref(x, q, s, block), ref) < 0.05  # the activations' own e4m3 rounding


def test_fp8_experts_ref_close_to_bf16_experts():
    torch.manual_seed(0)
    t, h, i, e, k = 9, 64, 96, 4, 2
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) * 0.1, torch.randn(e, h, i) * 0.1
    (q13, s13), (q2, s2) = quantize_weight(w13, E4M3, (32, 32)), quantize_weight(w2, E4M3, (32, 32))
    weights = torch.rand(t, k).softmax(-1)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    ids[0, 1] = -1  # an expert held elsewhere
    ref = fused_experts_ref(x, dequantize_weight(q13, s13, (32, 32)), dequantize_weight(q2, s2, (32, 32)), weights, ids)
    assert _rel(fused_experts_fp8_ref(x, q13, s13, q2, s2, weights, ids, (32, 32)), ref) < 0.06


def test_moe_plan_meta_per_gemm():
    """An MoE plan's launch meta per GEMM: its own N tile and overrides, else the shared keys."""
    from tandem.kernels.triton.fp8 import moe_gemm_meta
    plan = dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_N2=32, BLOCK_K=128, num_warps=2, num_stages=3, num_stages2=5)
    assert moe_gemm_meta(plan, 1, 128) == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=2, num_stages=3)
    assert moe_gemm_meta(plan, 2, None) == dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=5)
    with pytest.raises(ValueError, match="BLOCK_N2"):
        moe_gemm_meta({k: v for k, v in plan.items() if k != "BLOCK_N2"}, 2, 128)
    with pytest.raises(ValueError, match="must divide"):
        moe_gemm_meta(plan, 1, 64)  # BLOCK_K 128 over a 64-wide K block


# ---- Triton kernels: the same cases in the interpreter (CPU) and on a GPU -------------------------

GEMM_CASES = [  # (rows, N, K, block): the tile plans the kernels pick
    (1, 96, 256, None), (3, 200, 384, (128, 128)), (16, 64, 200, (1, 128)), (40, 130, 256, (128, 128)),
    (150, 96, 128, None), (70, 64, 256, (128, 128)),
]
SKINNY_CASES = [  # (rows, N, K, block, decode-tile plan): every branch of kernels/triton/fp8_skinny.py
    # per-channel, quantized in the GEMM, N strips past N, K split in 4 (tickets)
    (3, 40, 1024, None, dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=4, QUANT=True, num_warps=2, num_stages=4)),
    # block-scaled, quantized in the GEMM per K tile, the last split one tile deep
    (2, 200, 384, (128, 128), dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, QUANT=True, num_warps=2, num_stages=4)),
    # block-scaled with row scales (bn 1), quantized ahead, 32-row tile
    (20, 64, 256, (1, 128), dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, QUANT=False, num_warps=2, num_stages=4)),
    # per-channel quantized ahead, 64-row tile, ragged K (the second split is masked)
    (50, 72, 200, None, dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, QUANT=False, num_warps=4, num_stages=4)),
    # block-scaled, K 300 split in 4: the last split is past K (reads nothing, scale index clamped)
    (5, 48, 300, (128, 128), dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=4, QUANT=True, num_warps=2, num_stages=4)),
    # per-channel quantized in the GEMM, ragged K, no split
    (1, 24, 200, None, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, QUANT=True, num_warps=2, num_stages=4)),
    # two weight tiles before the PDL wait (64 rows), block-scaled; K 384 split in 2: the second
    # split is one tile deep, so its second preloaded tile is past K
    (40, 64, 384, (128, 128), dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, QUANT=False, num_warps=4, num_stages=4,
                                   PRELOAD=2)),
    # the same per-channel with ragged K
    (64, 48, 200, None, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, QUANT=False, num_warps=4, num_stages=4, PRELOAD=2)),
    # SWAP (the weight tile as the MMA's M side): block-scaled, quantized in the GEMM, strips past N,
    # the last split one tile deep
    (3, 200, 384, (128, 128), dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, QUANT=True, num_warps=4, num_stages=4,
                                   SWAP=True)),
    # SWAP per-channel quantized ahead, 32-row tile, ragged K
    (20, 130, 200, None, dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, QUANT=False, num_warps=4, num_stages=4,
                              SWAP=True)),
    # SWAP block-scaled quantized ahead, K 300 split in 4: the last split is past K
    (1, 96, 300, (128, 128), dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, QUANT=False, num_warps=4, num_stages=4,
                                  SWAP=True)),
    # four tiles before the PDL wait (PRELOAD 4, one stage), quantized in the GEMM; K 1000 split in 2: each
    # split is four tiles deep, the second's last ragged
    (1, 100, 1000, (128, 128), dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, QUANT=True, num_warps=4, num_stages=1,
                                    SWAP=True, PRELOAD=4)),
    # three tiles before the wait, then the loop; per-channel, quantized ahead, ragged K
    (2, 40, 700, None, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, QUANT=False, num_warps=2, num_stages=2, PRELOAD=3)),
]
MOE_CASES = [  # (tokens, hidden, inter, experts, top_k, block)
    (1, 128, 256, 8, 2, (128, 128)), (5, 128, 128, 4, 2, None), (70, 256, 128, 8, 3, (128, 128)),
]
MOE_PLANS = [  # (case, plan): the w13 and w2 GEMMs on different N tiles, warps, stages (benchmarks/fp8_moe.py)
    ((2, 256, 128, 8, 2, (128, 128)),
     dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_N2=32, BLOCK_K=128, num_warps=2, num_stages=3)),
    # per-channel, w2's K (96) ragged on BLOCK_K 64, per-GEMM warps and stages
    ((3, 128, 96, 4, 2, None), dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_N2=16, BLOCK_K=64, num_warps=4, num_stages=2,
                                    num_warps1=1, num_stages2=5)),
]


def _exact_rows(m: int, k: int, dtype, g: torch.Generator) -> torch.Tensor:
    """fp16 rows that quantize without rounding (for the interpreter, whose e4m3 cast misrounds):
    e4m3 values times 2^-6 with +-448 in every 32 columns, so every group's scale is 2^-6."""
    q = (torch.randn(m, k, generator=g) * 60).clamp(-448, 448).to(dtype).float()
    q[:, ::32] = 448.0 * (torch.randint(0, 2, (m, len(range(0, k, 32))), generator=g) * 2 - 1)
    return (q * 2.0**-6).half()


def run_gemm_case(case, device, dtype, cfg: dict | None = None) -> None:
    from tandem.kernels.triton.fp8 import fp8_linear_triton
    m, n, k, block = case
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05, dtype, block)
    if device == "cpu":
        x = _exact_rows(m, k, dtype, g)
    else:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q, s, x = q.to(device), s.to(device), x.to(device)
    ref = fp8_linear_ref(x.float(), q, s, block)  # the same quantized activations, float32 matmul
    for _ in range(2):  # the second call sees the split-K tickets the first put back
        out = fp8_linear_triton(x, q, s, block, cfg)
        assert _rel(out, ref) < 1e-2, (case, cfg, _rel(out, ref))


PENDING_NORM_CASES = [  # (rows, K1, N, N2, block): GEMM ahead [N, K1] leaves the norm, GEMM after [N2, N]
    (1, 256, 96, 64, None), (3, 384, 256, 128, (128, 128)), (16, 512, 128, 200, (128, 128)),
]


def run_pending_norm_case(case, device, dtype, quant_after: bool = True, swap: bool = False) -> None:
    """The FP8 decode GEMM ahead of an RMSNorm (o_proj-like: adds the residual, leaves the norm
    pending) and the GEMM after it applying it, against fp8_linear_ref + rms_norm_ref; the
    bf16 skinny GEMM (kernels/triton/linear.py) takes the same pending norm. quant_after: the
    GEMM after quantizes its rows itself (off in the interpreter, whose e4m3 cast misrounds).
    swap: both GEMMs on SWAP tiles (the weight as the MMA's M side)."""
    from tandem.kernels.norm import rms_norm_ref
    from tandem.kernels.triton.fp8_skinny import fp8_skinny_add_norm_triton, fp8_skinny_normed_triton
    from tandem.kernels.triton.linear import skinny_linear_normed_triton
    m, k1, n, n2, block = case
    g = torch.Generator().manual_seed(m * 100 + n)
    (q1, s1), (q2, s2) = (quantize_weight(torch.randn(n, k1, generator=g) * 0.05, dtype, block),
                          quantize_weight(torch.randn(n2, n, generator=g) * 0.05, dtype, block))
    act = torch.float16 if device == "cpu" else torch.bfloat16
    x = _exact_rows(m, k1, dtype, g) if device == "cpu" else torch.randn(m, k1, generator=g).to(act)
    res, nw = torch.randn(m, n, generator=g).to(act), (1 + 0.3 * torch.randn(n, generator=g)).to(act)
    w_dense = (torch.randn(n2, n, generator=g) / n**0.5).to(act)
    q1, s1, q2, s2, x, res, nw, w_dense = (t.to(device) for t in (q1, s1, q2, s2, x, res, nw, w_dense))
    ahead = dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2 if k1 >= 256 else 1, QUANT=True, num_warps=2, num_stages=4)
    after = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, QUANT=quant_after, num_warps=2, num_stages=4)
    if swap:
        ahead, after = dict(ahead, BLOCK_N=64, num_warps=4, SWAP=True), dict(after, BLOCK_N=128, num_warps=4, SWAP=True)
    s_ref = (fp8_linear_ref(x.float(), q1, s1, block).to(act).float() + res.float()).to(act)
    h_ref = rms_norm_ref(s_ref, nw, 1e-6)
    y_ref = fp8_linear_ref(h_ref.float(), q2, s2, block)
    for _ in range(2):  # the second call sees the split-K tickets the first put back
        s, sg, ss = fp8_skinny_add_norm_triton(x, q1, s1, block, res, nw, ahead)
        assert _rel(s, s_ref) < 1e-2 and _rel(sg, s_ref.float() * nw.float()) < 1e-2, case
        y = fp8_skinny_normed_triton(sg, q2, s2, block, ss, 1e-6, after)
        # The kernel quantizes the rows s * g and scales by 1 / rms after the GEMM: against that
        # order of operations it is exact to accumulation; against norm-then-quantize, a few of
        # the elements round to the neighbouring fp8 value (one e4m3 step is 6%; case0 has 96).
        inv_rms = torch.rsqrt(s_ref.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert _rel(y, fp8_linear_ref(sg.float(), q2, s2, block) * inv_rms) < 1e-2, case
        assert _rel(y, y_ref) < 4e-2, (case, _rel(y, y_ref))
        dense = skinny_linear_normed_triton(sg, w_dense, ss, 1e-6)
        assert _rel(dense, h_ref.double() @ w_dense.double().t()) < 5e-3, case


W8A16_CASES = [  # (rows, N, K, block, plan): fp8 weights in the bf16 skinny GEMM (kernels/triton/linear.py)
    # per-channel, K split in 2 (tickets)
    (1, 96, 256, None, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=2, num_stages=4)),
    # block-scaled, strips past N, the last split one tile deep
    (3, 200, 384, (128, 128), dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=2, num_stages=4)),
    # row scales (bn 1), K tiles half the K block
    (16, 64, 256, (1, 128), dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=4, num_warps=2, num_stages=4)),
    # K 300 split in 4: the last split is past K (reads nothing, scale index kept in the grid)
    (5, 48, 300, (128, 128), dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=4, num_warps=2, num_stages=4)),
    # per-channel, ragged K, no split, the first tile behind the PDL wait
    (2, 40, 200, None, dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=3, PRELOAD=False)),
]
W8A16_MOE_CASES = [  # (tokens, hidden, inter, experts, top_k, block): routed experts with fp8 weights
    (1, 128, 256, 8, 2, (128, 128)),  # a block per pair, routing in the first GEMM, fused sum
    (3, 128, 128, 4, 2, None),  # per-channel
    (10, 256, 128, 8, 3, (128, 128)),  # 30 pairs: the routing launch, grouped blocks, the sum launch
    (2, 64, 96, 4, 2, (32, 32)),  # K blocks narrower than the plan's K tile (clamped to 32)
]


def _w8a16_rows(m: int, k: int, device: str, g: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, generator=g).to(torch.float16 if device == "cpu" else torch.bfloat16).to(device)


def run_w8a16_case(case, device, dtype, cfg: dict | None = None) -> None:
    """The bf16 skinny GEMM reading fp8 weights (W8A16) against fp8_linear_w8a16_ref (x times the
    dequantized weight in float32); with a pending norm: the GEMM ahead adds the residual, the
    GEMM after applies the norm, against w8a16_ref + rms_norm_ref."""
    from tandem.kernels.fp8 import fp8_linear_w8a16_ref
    from tandem.kernels.norm import rms_norm_ref
    from tandem.kernels.triton.linear import (skinny_linear_add_norm_triton, skinny_linear_normed_triton,
                                              skinny_linear_triton)
    m, n, k, block = case
    g = torch.Generator().manual_seed(m * 1000 + n + 1)
    q, s = (t.to(device) for t in quantize_weight(torch.randn(n, k, generator=g) * 0.05, dtype, block))
    x = _w8a16_rows(m, k, device, g)
    ref = fp8_linear_w8a16_ref(x.float(), q, s, block)
    for _ in range(2):  # the second call sees the split-K tickets the first put back
        out = skinny_linear_triton(x, q, cfg, w_scale=s, block=block)
        assert _rel(out, ref) < 1e-2, (case, cfg, _rel(out, ref))
    res, nw = _w8a16_rows(m, n, device, g), (1 + 0.3 * torch.randn(n, generator=g)).to(x.dtype).to(device)
    q2, s2 = (t.to(device) for t in quantize_weight(torch.randn(24, n, generator=g) * 0.05, dtype, block))
    s_ref = (fp8_linear_w8a16_ref(x.float(), q, s, block).to(x.dtype).float() + res.float()).to(x.dtype)
    y_ref = fp8_linear_w8a16_ref(rms_norm_ref(s_ref, nw, 1e-6).float(), q2, s2, block)
    after = None if cfg is None else dict(cfg, SPLIT_K=1)  # (N of the GEMM ahead is the one after's K)
    if after is not None and block is not None and n % after["BLOCK_K"]:
        after["BLOCK_K"] = 16
    for _ in range(2):
        s_, sg, ss = skinny_linear_add_norm_triton(x, q, res, nw, cfg, w_scale=s, block=block)
        assert _rel(s_, s_ref) < 1e-2 and _rel(sg, s_ref.float() * nw.float()) < 1e-2, (case, cfg)
        y = skinny_linear_normed_triton(sg, q2, ss, 1e-6, after, w_scale=s2, block=block)
        assert _rel(y, y_ref) < 1e-2, (case, cfg, _rel(y, y_ref))


def run_w8a16_moe_case(case, device, dtype, cfg: dict | None = None) -> None:
    """The routed bf16 experts reading fp8 weights (scales given) against kernels.moe.routed_experts'
    reference on the same operands (routing, then the experts on the dequantized weights)."""
    from tandem.kernels.moe import routed_experts
    from tandem.kernels.triton.moe import routed_experts_triton
    t, h, i, e, k, block = case
    g = torch.Generator().manual_seed(t * 11 + e)
    (q13, s13), (q2, s2) = (quantize_weight(torch.randn(e, 2 * i, h, generator=g) * 0.1, dtype, block),
                            quantize_weight(torch.randn(e, h, i, generator=g) * 0.1, dtype, block))
    x, logits = _w8a16_rows(t, h, "cpu", g), torch.randn(t, e, generator=g)
    ref = routed_experts(x.float(), logits, q13, q2, k, True, scales=(s13, s2, block))
    x, logits, q13, s13, q2, s2 = (a.to(device) for a in (x, logits.to(x.dtype), q13, s13, q2, s2))
    for _ in range(2):  # the fused sum's tickets, put back
        out = routed_experts_triton(x, logits, q13, q2, k, True, scales=(s13, s2, block))
        assert _rel(out.cpu(), ref) < 2e-2, (case, _rel(out.cpu(), ref))


def run_moe_case(case, device, dtype, cfg: dict | None = None) -> None:
    from tandem.kernels.triton.fp8 import fused_experts_fp8_triton
    t, h, i, e, k, block = case
    g = torch.Generator().manual_seed(t * 7 + e)
    (q13, s13), (q2, s2) = (quantize_weight(torch.randn(e, 2 * i, h, generator=g) * 0.1, dtype, block),
                            quantize_weight(torch.randn(e, h, i, generator=g) * 0.1, dtype, block))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16 if device != "cpu" else torch.float16)
    weights = torch.rand(t, k, generator=g).softmax(-1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    args = [a.to(device) for a in (x, q13, s13, q2, s2, weights, ids)]
    out = fused_experts_fp8_triton(*args, block, cfg)
    ref = fused_experts_fp8_ref(*args, block)
    assert _rel(out, ref) < 2e-2, (case, cfg, _rel(out, ref))


def run_quant_case(device, dtype, exact: bool) -> None:
    from tandem.kernels.triton.fp8 import quantize_rows_triton
    x = torch.randn(5, 300).to(torch.bfloat16 if device != "cpu" else torch.float16).to(device)
    for group in (None, 128, 32):
        q, s = quantize_rows(x, dtype, group)
        q2, s2 = quantize_rows_triton(x, dtype, group)
        assert torch.allclose(s, s2, rtol=1e-6, atol=0)
        if exact:
            assert torch.equal(q.float(), q2.float())
        else:
            assert _rel(q2.float(), q.float()) < 0.1  # (misrounded values are off by half)
    # padded to 8 rows with the scales column-major (torch's block-wise GEMM's operands): the same
    # rows, then zero rows with the floor scale
    q3, s3 = quantize_rows_triton(x, dtype, 128, rows=8, scales_by_column=True)
    q, s = quantize_rows(x, dtype, 128)
    assert q3.shape == (8, 300) and s3.shape == (8, 3) and s3.stride() == (1, 8)
    assert torch.allclose(s3[:5], s, rtol=1e-6, atol=0) and torch.all(s3[5:] == 1e-12)
    assert torch.equal(q3[5:].float(), torch.zeros(3, 300, device=device))
    assert torch.equal(q3[:5].float(), q.float()) if exact else _rel(q3[:5].float(), q.float()) < 0.1
    # rows grouped by expert in blocks of 4 (moe_align's layout) with 3 and 1 real rows: those rows
    # quantized as quantize_rows does, by both kernels (per token: the two-pass one)
    x8 = torch.randn(8, 300).to(x.dtype).to(device)
    real = torch.tensor([0, 1, 2, 4], device=device)
    for group in (None, 128):
        q, s = quantize_rows(x8, dtype, group)
        q4, s4 = quantize_rows_triton(x8, dtype, group, blocks=(torch.tensor([3, 1], device=device,
                                                                             dtype=torch.int32), 4))
        assert torch.allclose(s4[real], s[real], rtol=1e-6, atol=0)
        if exact:
            assert torch.equal(q4[real].float(), q[real].float())
        else:
            assert _rel(q4[real].float(), q[real].float()) < 0.1


def run_fused_quant_case(device, dtype, exact: bool) -> None:
    """The RMSNorm (alone and with the residual add) and SiLU-and-mul kernels writing the next FP8
    GEMM's input quantized (KernelConfig.fuse_fp8_quant) against quantize_rows of the references'
    outputs (ragged groups included); then the 64-row FP8 GEMM on rows quantized ahead against the
    reference GEMM on the same rows."""
    from tandem.kernels.fp8 import _quantized_linear_ref, rms_norm_quant_ref, silu_and_mul_quant_ref
    from tandem.kernels.triton.activation import silu_and_mul_quant_triton
    from tandem.kernels.triton.fp8_skinny import fp8_skinny_linear_triton
    from tandem.kernels.triton.norm import rms_norm_quant_triton
    act = torch.bfloat16 if device != "cpu" else torch.float16
    gen = torch.Generator().manual_seed(0)

    def rows(*shape):
        return torch.randn(*shape, generator=gen).to(act).to(device)

    def check(got, ref):
        assert torch.allclose(got[1], ref[1], rtol=1e-6, atol=0)
        assert torch.equal(got[0].float(), ref[0].float()) if exact else _rel(got[0].float(), ref[0].float()) < 0.1
    for hidden, group in ((256, 128), (200, 64), (96, 128)):
        x, res = rows(20, hidden), rows(20, hidden)
        w = (torch.rand(hidden, generator=gen) + 0.5).to(act).to(device)
        for residual in (None, res):
            q, s, summed = rms_norm_quant_triton(x, residual, w, 1e-6, dtype, group, pdl=False)
            q_ref, s_ref, summed_ref = rms_norm_quant_ref(x, residual, w, 1e-6, dtype, group)
            check((q, s), (q_ref, s_ref))
            assert s.shape == (20, -(-hidden // group)) and q.dtype == dtype
            assert summed_ref is None if residual is None else torch.equal(summed, summed_ref)
    for d, group in ((300, 128), (2500, 128), (96, 32), (48, 64)):
        x = rows(20, 2 * d)
        check(silu_and_mul_quant_triton(x, dtype, group, pdl=False), silu_and_mul_quant_ref(x, dtype, group))
    xq, xs = quantize_rows(rows(40, 256), dtype, 128)
    wq, ws = quantize_weight(torch.randn(192, 256, generator=gen).to(device) * 0.05, dtype, (128, 128))
    y = fp8_skinny_linear_triton(xq, wq, ws, (128, 128), pdl=False, quantized=xs, dtype=act)
    ref = _quantized_linear_ref(xq, xs, wq, ws, (128, 128), None, act)
    assert y.dtype == act and _rel(y.float(), ref.float()) < 2e-2


def _interpreter_main() -> None:
    import tandem.kernels.triton.fp8 as triton_fp8
    results = {}
    try:
        run_quant_case("cpu", E4M3, exact=False)
        results["quant"] = ""
    except Exception as exc:
        results["quant"] = f"{type(exc).__name__}: {exc}"
    try:
        run_fused_quant_case("cpu", E4M3, exact=False)
        results["fusedquant"] = ""
    except Exception as exc:
        results["fusedquant"] = f"{type(exc).__name__}: {exc}"
    # (the interpreter's e4m3 cast misrounds; docstring)
    from tandem.kernels.triton import fp8_skinny
    triton_fp8.quantize_rows_triton = fp8_skinny.quantize_rows_triton = (
        lambda x, dtype, group, pdl=False, blocks=None: quantize_rows(x, dtype, group))
    skinny = [lambda case=case: run_gemm_case(case[:4], "cpu", E4M3, case[4]) for case in SKINNY_CASES]
    for idx, fn in enumerate(skinny):
        try:
            fn()
            results[f"skinny{idx}"] = ""
        except Exception as exc:  # reported per case by the parent
            results[f"skinny{idx}"] = f"{type(exc).__name__}: {exc}"
    pending = lambda case, device, dtype: run_pending_norm_case(case, device, dtype, quant_after=False)  # noqa: E731
    moe_plan = lambda case, device, dtype: run_moe_case(case[0], device, dtype, case[1])  # noqa: E731
    w8a16 = lambda case, device, dtype: run_w8a16_case(case[:4], device, dtype, case[4])  # noqa: E731
    for kind, cases, fn in (("w8a16_", W8A16_CASES, w8a16), ("w8a16moe", W8A16_MOE_CASES, run_w8a16_moe_case),
                            ("gemm", GEMM_CASES, run_gemm_case), ("moe", MOE_CASES, run_moe_case),
                            ("pending", PENDING_NORM_CASES, pending), ("moeplan", MOE_PLANS, moe_plan)):
        for idx, case in enumerate(cases):
            try:
                fn(case, "cpu", E4M3)
                results[f"{kind}{idx}"] = ""
            except Exception as exc:  # reported per case by the parent
                results[f"{kind}{idx}"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    stdout = run_under_interpreter("tests.kernels.test_fp8", timeout=900)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["quant", "fusedquant"] + [f"gemm{i}" for i in range(len(GEMM_CASES))] +
                         [f"skinny{i}" for i in range(len(SKINNY_CASES))] +
                         [f"pending{i}" for i in range(len(PENDING_NORM_CASES))] +
                         [f"moe{i}" for i in range(len(MOE_CASES))] + [f"moeplan{i}" for i in range(len(MOE_PLANS))] +
                         [f"w8a16_{i}" for i in range(len(W8A16_CASES))] +
                         [f"w8a16moe{i}" for i in range(len(W8A16_MOE_CASES))])
def test_fp8_kernel_in_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "", interpreter_results[case]


@pytest.mark.gpu
def test_fp8_quantize_rows_gpu():
    run_quant_case("cuda", fp8_gpu_dtype(), exact=True)


@pytest.mark.gpu
def test_fp8_fused_quant_gpu():
    run_fused_quant_case("cuda", fp8_gpu_dtype(), exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GEMM_CASES + [(1, 4096, 4096, (128, 128)), (16, 14336, 4096, None),
                                               (4096, 4096, 4096, (128, 128)), (512, 12288, 4096, None)])
def test_fp8_gemm_gpu(case):
    run_gemm_case(case, "cuda", fp8_gpu_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("case", SKINNY_CASES)
def test_fp8_skinny_plans_gpu(case):
    run_gemm_case(case[:4], "cuda", fp8_gpu_dtype(), case[4])


def _table_plan_cases() -> list[tuple]:
    from tandem.kernels.triton.fp8_skinny import PLANS
    return [(bucket, n, k, (128, block_k) if block_k else None) for bucket, n, k, block_k in PLANS]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _table_plan_cases())
def test_fp8_skinny_table_plans_gpu(case):
    """Every plan of the decode tile's table (fp8_skinny.PLANS), as the step launches it (PRELOAD
    included), on its own weight shape at the row bucket's most rows, against fp8_linear_ref."""
    run_gemm_case(case, "cuda", fp8_gpu_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(150, 256, 256, (128, 128)), (200, 128, 384, (128, 128)), (130, 384, 512, None),
                                  (129, 4096, 4096, (128, 128)), (1000, 6144, 4096, None)])
def test_fp8_torch_gemm_gpu(case):
    """Prefill rows on torch's FP8 GEMM (the rows padded to 128 and the scales column-major by the
    quantization launch, block-wise) against fp8_linear_ref; block-wise K of 256 and 384 (torch
    refuses weight scales whose K side is not a multiple of 4) take the prefill tile instead."""
    import torch.nn.functional as F

    from tandem.kernels.triton.fp8 import _torch_gemm
    m, n, k, block = case
    dtype = fp8_gpu_dtype()
    if torch.cuda.get_device_capability() >= (9, 0) and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        takes = _torch_gemm(torch.empty(m, k, device="cuda"), torch.empty(n, k, device="cuda"), block)
        assert takes == (block is None or k % 512 == 0), case
    run_gemm_case(case, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PENDING_NORM_CASES)
@pytest.mark.parametrize("quant_after", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_fp8_pending_norm_gpu(case, quant_after, swap):
    run_pending_norm_case(case, "cuda", fp8_gpu_dtype(), quant_after, swap)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 33, 64, 65])
def test_fp8_gemm_model_shapes_gpu(m, block):
    """Every Llama-3-8B / Qwen3-30B-A3B projection with the plan the kernels pick at m rows (each
    decode-tile row bucket and its edges, the first prefill tile)."""
    for n, k in LLAMA_8B + QWEN3_30B:
        run_gemm_case((m, n, k, block), "cuda", fp8_gpu_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOE_CASES + [(1, 2048, 768, 128, 8, (128, 128)), (512, 2048, 768, 128, 8, (128, 128)),
                                              (64, 4096, 1536, 8, 2, None)])
def test_fp8_experts_gpu(case):
    run_moe_case(case, "cuda", fp8_gpu_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOE_PLANS + [
    ((1, 2048, 768, 128, 8, (128, 128)),
     dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_N2=32, BLOCK_K=128, num_warps=2, num_stages=3)),
    ((16, 2048, 768, 128, 8, None), dict(BLOCK_M=16, BLOCK_N1=128, BLOCK_N2=16, BLOCK_K=128, num_warps=4, num_stages=5,
                                         num_warps2=1, num_stages2=2))])
def test_fp8_experts_split_plans_gpu(case):
    """Plans whose two expert GEMMs differ (benchmarks/fp8_moe.py's sweep) against the reference."""
    run_moe_case(case[0], "cuda", fp8_gpu_dtype(), case[1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", W8A16_CASES)
def test_fp8_w8a16_plans_gpu(case):
    run_w8a16_case(case[:4], "cuda", fp8_gpu_dtype(), case[4])


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_fp8_w8a16_model_shapes_gpu(m, block):
    """Every Llama-3-8B / Qwen3-30B-A3B projection with the W8A16 plan the GEMM picks."""
    for n, k in LLAMA_8B + QWEN3_30B:
        run_w8a16_case((m, n, k, block), "cuda", fp8_gpu_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("case", W8A16_MOE_CASES + [(1, 2048, 768, 128, 8, (128, 128)), (2, 2048, 768, 128, 8, None),
                                                   (16, 2048, 768, 128, 8, (128, 128))])
def test_fp8_w8a16_experts_gpu(case):
    run_w8a16_moe_case(case, "cuda", fp8_gpu_dtype())


FP8_KV_MODES = ["f16", "f16-pin-k", "int", "cvt"]  # how the kernel reads e4m3 K/V (_fp8_kv_attention)


def _fp8_kv_attention(ctx: list[int], q_len: int, hk: int, hq: int, mode: str):
    """(Triton, reference) attention of q_len new tokens a sequence over an fp8 cache of contexts ctx
    (16-token pages in a shuffled table, head dim 128), both reading the same cache contents. mode:
    K/V into f16 by cvt, f16 with K's conversion pinned (the PIN_K plan knob), bf16 by integer ops,
    bf16 by Triton's conversion."""
    from tandem.kernels.attention import paged_attention_ref
    from tandem.kernels.triton import attention
    from tandem.kernels.triton.attention import paged_attention_triton
    dtype = fp8_gpu_dtype()
    torch.manual_seed(0)
    page, d, seqs, max_ctx = 16, 128, len(ctx), max(ctx)
    pages = -(-max_ctx // page)
    k_cache = torch.randn(seqs * pages, page, hk, d, device="cuda").to(dtype)
    v_cache = torch.randn(seqs * pages, page, hk, d, device="cuda").to(dtype)
    q = torch.randn(seqs * q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(seqs * pages, device="cuda", dtype=torch.int32).view(seqs, pages)
    seq_lens = torch.tensor(ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * q_len
    rule = attention._launch_plans
    if mode == "f16-pin-k":
        attention._launch_plans = lambda *a, **kw: [dict(p, PIN_K=True) for p in rule(*a, **kw)]
    try:
        out = paged_attention_triton(q, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5, q_len, max_ctx,
                                     int_convert=mode == "int", kv_f16=mode.startswith("f16"))
    finally:
        attention._launch_plans = rule
    return out, paged_attention_ref(q, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FP8_KV_MODES)
@pytest.mark.parametrize("q_len", [1, 37])
def test_paged_attention_fp8_kv_gpu(q_len, mode):
    """The Triton attention reads an fp8 cache like the reference does (same cache contents), with
    K/V read into f16 (kernels/triton/e4m3.py e4m3_to_f16), or into bf16 by integer ops or by cvt."""
    out, ref = _fp8_kv_attention([150], q_len, hk=2, hq=8, mode=mode)
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FP8_KV_MODES)
def test_paged_attention_fp8_kv_decode_batch_gpu(mode):
    """A full decode batch over an fp8 cache (64 sequences, Llama-3-8B heads): the grid is large enough
    that the launch has no split-K (the b=64 roofline's plan, which the single-sequence cases above
    never take), against the reference on the same cache."""
    from tandem.kernels.triton.attention import _launch_plans
    seqs, hk, hq = 64, 8, 32
    ctx = torch.randint(1, 400, (seqs,), generator=torch.Generator().manual_seed(1)).tolist()
    q = torch.empty(seqs, hq, 128, device="cuda", dtype=torch.bfloat16)  # (the plan reads its shape only)
    plans = _launch_plans(q, hq // hk, seqs, hk, 1, max(ctx), kv_bytes=1)
    assert len(plans) == 1 and plans[0]["NUM_SPLITS"] == 1, plans
    out, ref = _fp8_kv_attention(ctx, 1, hk, hq, mode)
    assert _rel(out, ref) < 2e-2



def test_fp8_cache_decode_plans_by_grid(monkeypatch):
    """The decode attention's plan over an fp8 cache by grid size (132 SMs, graph bound 8192 keys): a batch
    of one or two keeps the split-K plans chosen in the b=1 step (8 warps, the last tile early; KV_AHEAD with 4
    KV heads); a
    mid-sized grid splits only up to two programs an SM, 4 warps, 128-key tiles; a bf16 cache as before."""
    from tandem.kernels.triton import attention

    monkeypatch.setattr(attention, "num_sms", lambda device: 132)

    def plan(seqs, hk, kv_bytes=1):
        q = torch.empty(seqs, 32, 128, dtype=torch.bfloat16)
        (p,) = attention._launch_plans(q, 32 // hk, seqs, hk, 1, 8192, kv_bytes=kv_bytes)
        return {k: v for k, v in p.items() if k not in ("Q_RANGE", "BLOCK_M")}

    early = dict(KV_EARLY=True, KV_READBACK=True)
    assert plan(1, 8) == dict(BLOCK_N=128, NUM_SPLITS=64, num_warps=8, num_stages=1, **early)
    assert plan(2, 8) == dict(BLOCK_N=128, NUM_SPLITS=32, num_warps=8, num_stages=1, **early)
    assert plan(4, 4) == dict(BLOCK_N=64, NUM_SPLITS=32, num_warps=8, num_stages=2, KV_AHEAD=True, **early)
    assert "KV_EARLY" not in plan(64, 8)  # (the full grid: the b=64 step lost 19% with it)
    mid = dict(BLOCK_N=128, num_warps=4, num_stages=2)
    assert [plan(s, hk) for s, hk in ((8, 4), (32, 4), (64, 4), (16, 8), (32, 8))] == [
        dict(mid, NUM_SPLITS=8), dict(mid, NUM_SPLITS=2), dict(mid, NUM_SPLITS=1), dict(mid, NUM_SPLITS=2),
        dict(mid, NUM_SPLITS=1)]
    assert plan(32, 4, kv_bytes=2) == dict(BLOCK_N=128, NUM_SPLITS=4, num_warps=4, num_stages=2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FP8_KV_MODES)
@pytest.mark.parametrize("seqs,hk", [(8, 4), (32, 4), (64, 4), (16, 8), (32, 8)])
def test_paged_attention_fp8_kv_mid_batch_gpu(seqs, hk, mode):
    """Decode batches whose grid is more than a batch of one or two takes and under two programs an SM
    (the mid-grid plans: 4 warps, split-K only up to two programs an SM, or none), Llama-3-8B and
    Qwen3-30B-A3B heads over an fp8 cache with ragged contexts, against the reference on the same cache."""
    from tandem.kernels.triton.attention import _launch_plans
    hq = 32
    ctx = torch.randint(1, 1500, (seqs,), generator=torch.Generator().manual_seed(seqs)).tolist()
    q = torch.empty(seqs, hq, 128, device="cuda", dtype=torch.bfloat16)  # (the plan reads its shape only)
    plan = _launch_plans(q, hq // hk, seqs, hk, 1, max(ctx), kv_bytes=1)
    assert len(plan) == 1 and plan[0]["num_warps"] == 4 and "KV_AHEAD" not in plan[0], plan
    out, ref = _fp8_kv_attention(ctx, 1, hk, hq, mode)
    assert _rel(out, ref) < 2e-2


if __name__ == "__main__":
    _interpreter_main()


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
QWEN3_30B = [(5120, 2048), (2048, 4096)]  # its dense projections: qkv, o
SMEM_LIMIT = 227 * 1024  # an H100's shared memory per block


def _compile_sm90(fn, types: dict, consts: dict, num_warps: int, num_stages: int):
    """Compile a kernel for sm_90 without a GPU, with the pointer/stride divisibility a real launch
    sees (so loads vectorize and pipeline as they would)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = fn.arg_names
    unset = [p.name for p in fn.params if p.is_constexpr and p.name not in consts and not p.has_default]
    assert not unset, f"{fn.__name__}: constexprs {unset} have no value (they would compile as runtime ints)"
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    div16 = [n for n in names if n.endswith("_ptr") or n.startswith("stride_") or n in ("N", "K")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16 if n not in consts}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def _sm90_plans() -> list[tuple]:
    from tandem.kernels.triton.fp8 import gemm_config
    from tandem.kernels.triton.fp8_skinny import plans
    out = []
    for block_k in (128, None):
        out += [("skinny", block_k, bucket, p) for bucket, p in plans(LLAMA_8B + QWEN3_30B, block_k)]
        for m in (128, 4096):
            for n, _ in LLAMA_8B:
                p = gemm_config(m, n, block_k)
                if ("prefill", block_k, m, p) not in out:
                    out.append(("prefill", block_k, m, p))
    return out


def test_fp8_gemm_plans_compile_for_sm90():
    """Without a GPU: every tile plan the FP8 GEMMs take for the Llama-3-8B and Qwen3-30B-A3B
    projections compiles for sm_90 to fp8 tensor-core instructions with pipelined (cp.async)
    loads where it has stages, inside an H100's shared memory."""
    from tandem.kernels.triton.fp8 import _fp8_gemm_kernel
    from tandem.kernels.triton.fp8_skinny import _fp8_skinny_kernel, w_scalar
    ptrs = dict(xs_ptr="*fp32", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32",
                ticket_ptr="*i32", a_ptr="*fp8e4nv", fp8_max="fp32", res_ptr="*bf16", g_ptr="*bf16", sg_ptr="*bf16",
                ss_ptr="*fp32", ss_in_ptr="*fp32", eps="fp32")
    for kind, block_k, rows, plan in _sm90_plans():
        p = dict(plan)
        warps, stages = p.pop("num_warps"), p.pop("num_stages")
        if kind == "skinny":
            quant = p.pop("QUANT")
            norm_out = rows == 16 and quant  # the GEMM ahead of a pending norm (NORM_OUT) at 16 rows
            consts = dict(BLOCK_M=rows, SPLIT_K=p.pop("SPLIT_K"), EVEN_K=True, PER_CHANNEL=block_k is None,
                          QUANT=quant, NORM_OUT=norm_out, NORM_IN=rows == 16 and not norm_out, S_PAD=256, PDL=True,
                          W_SCALAR=w_scalar((128, block_k) if block_k else None, p["BLOCK_N"]),  # as _launch
                          **dict(dict(PRELOAD=1, SWAP=False), **p))
            compiled = _compile_sm90(_fp8_skinny_kernel, dict(ptrs, x_ptr="*bf16" if quant else "*fp8e4nv"), consts,
                                     warps, stages)
        else:
            consts = dict(PER_CHANNEL=block_k is None, EVEN_K=True, **p)
            compiled = _compile_sm90(_fp8_gemm_kernel, ptrs, consts, warps, stages)
        ptx, what = compiled.asm["ptx"], (kind, block_k, rows, plan)
        assert "e4m3" in ptx and ("wgmma" in ptx or "mma.sync" in ptx), what
        if stages > 1:  # (one-stage plans load every tile of a program before the PDL wait, no loop to pipeline)
            assert "cp.async" in ptx, what
        assert compiled.metadata.shared <= SMEM_LIMIT, (what, compiled.metadata.shared)


# _paged_attention_kernel's pointer and float arguments as a bf16 model's decode over an e4m3 cache passes them
DECODE_ATTENTION_PTRS = dict(
    q_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", out_ptr="*bf16", part_acc_ptr="*fp32",
    part_ml_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32",
    k_new_ptr="*bf16", v_new_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*bf16", slot_ptr="*i64", qw_ptr="*bf16",
    kw_ptr="*bf16", eps="fp32", q8_ptr="*fp8e4nv", q8s_ptr="*fp32", fp8_max="fp32")


MERGE_PTRS = dict(out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32", query_start_loc_ptr="*i32",
                  seq_lens_ptr="*i32", q8_ptr="*fp8e4nv", q8s_ptr="*fp32", fp8_max="fp32")


def _compile_merge(**changes):
    """_merge_splits_kernel for sm_90 (one decode token's 64 splits of a head of 128, 4 warps), with constexpr
    changes; TRACE adds its trace pointer."""
    from tandem.kernels.triton.attention import _merge_splits_kernel
    consts = dict(dict(NUM_SPLITS=64, D_PAD=128, BLOCK_Q=4, BLOCK_N=128, PDL=True, QUANT_OUT=False, EARLY=True),
                  **changes)
    ptrs = dict(MERGE_PTRS, trace_ptr="*i64") if consts.get("TRACE") else MERGE_PTRS
    return _compile_sm90(_merge_splits_kernel, ptrs, consts, 4, 1)


def _decode_attention_consts(**changes) -> dict:
    """_paged_attention_kernel's constexprs for one Llama-3-8B decode over an e4m3 cache (rope fused, 64-key tiles,
    no split, f16 dots), with changes."""
    return dict(dict(GROUP=4, BLOCK_Q=4, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128, D_PAD=128, PAGE=16, NUM_SPLITS=1,
                     HEAVY_FIRST=True, OFFS_32=True, DENSE=False, BT_SCALAR=False, ROPE=True, QK_NORM=False, ROT=128,
                     FAST_CVT=2, PDL=True, KV_AHEAD=False, QUANT_OUT=False, PIN_K=False, KV_EARLY=False), **changes)


@pytest.mark.parametrize("cvt,kv_ahead,quant_out,splits,pin_k,kv_early", [
    (1, False, False, 1, False, False), (1, True, False, 1, False, False), (1, False, True, 1, False, False),
    (2, False, False, 1, False, False), (2, False, False, 1, True, False), (2, False, True, 1, False, False),
    (2, False, False, 4, False, False), (2, True, False, 4, False, False), (2, False, True, 4, False, True),
    (2, True, True, 4, False, True)])
def test_fp8_cache_decode_attention_compiles_for_sm90(cvt, kv_ahead, quant_out, splits, pin_k, kv_early):
    """Without a GPU: decode attention over an e4m3 cache (Llama-3-8B heads, rope fused, 64-key tiles)
    compiles for sm_90 to tensor-core instructions, bf16 fed by the integer conversion (FAST_CVT 1) or
    f16 fed by cvt.rn.f16x2.e4m3x2 (2), with Triton's cp.async pipelining at 2 stages, and with
    KV_AHEAD at 1 stage pipelined by hand (plain loads a tile ahead, no cp.async); QUANT_OUT (its
    output written as the o projection's fp8 input) changes only the epilogue. KV_EARLY: the last
    tile's loads come before the PDL wait."""
    from tandem.kernels.triton.attention import _paged_attention_kernel
    consts = _decode_attention_consts(NUM_SPLITS=splits, FAST_CVT=cvt, KV_AHEAD=kv_ahead, QUANT_OUT=quant_out,
                                      PIN_K=pin_k, KV_EARLY=kv_early)
    compiled = _compile_sm90(_paged_attention_kernel, DECODE_ATTENTION_PTRS, consts, 8 if splits > 1 else 4,
                             1 if kv_ahead else 2)
    ptx = compiled.asm["ptx"]
    # ahead of the wait, 16-byte loads are the K/V tile's only (the metadata's are scalars): 2 x 64 rows of 128
    # bytes over 256 threads, 4 a thread
    assert ptx.split("griddepcontrol.wait")[0].count("ld.global.v4") == (4 if kv_early else 0)
    ty = "f16" if cvt == 2 else "bf16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32" in ptx
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (cvt == 2)
    assert ("cp.async" in ptx) != kv_ahead
    assert compiled.metadata.shared <= SMEM_LIMIT
    if not kv_ahead:
        # the V tile's e4m3 conversion stays in the load's layout (PIN_V): no byte-wide shared-memory
        # reads, which the conversion moved behind the dot operand's layout compiled to (64 a warp a tile)
        sass = _sass(compiled.asm["cubin"])
        assert "LDSM.16.MT88" in sass  # V reaches the dot through ldmatrix.trans
        assert "LDS.U8" not in sass


def test_fp8_cache_decode_attention_prefetch_compiles_for_sm90():
    """Without a GPU: the Llama-3-8B batch-1 split plan (128-key tiles, 8 warps) with KV_PREFETCH in place of
    KV_EARLY prefetches its last tile's K and V rows into L2 before the PDL wait (one 128-byte line a row: 2 x 128
    prefetches over 256 threads) and loads no tile there, so nothing is held in registers across the wait."""
    from tandem.kernels.triton.attention import _paged_attention_kernel
    consts = _decode_attention_consts(BLOCK_N=128, NUM_SPLITS=64, KV_PREFETCH=True)
    ptx = _compile_sm90(_paged_attention_kernel, DECODE_ATTENTION_PTRS, consts, 8, 2).asm["ptx"]
    ahead, after = ptx.split("griddepcontrol.wait")
    assert ahead.count("prefetch.global.L2") >= 2 and "prefetch.global.L2" not in after
    assert "ld.global.v4" not in ahead and "cp.async" in after


def test_fp8_cache_decode_attention_readback_compiles_for_sm90():
    """Without a GPU: the Llama-3-8B batch-1 split plan (128-key tiles, 8 warps, KV_EARLY), at 2 stages as before the
    rule took one (test_fp8_tma compiles the rule's), with KV_READBACK
    (the new key's row read back into the early tile from the cache, that tile taken first) still loads its last
    tile before the PDL wait, and takes at most 128 registers a thread, half an SM's register file at 8 warps; with
    the new key put in from registers it takes near all of it (the key takes the tile's layout)."""
    from tandem.kernels.triton.attention import _paged_attention_kernel
    registers = {}
    for readback in (True, False):
        consts = _decode_attention_consts(BLOCK_N=128, NUM_SPLITS=64, KV_EARLY=True, KV_READBACK=readback)
        compiled = _compile_sm90(_paged_attention_kernel, DECODE_ATTENTION_PTRS, consts, 8, 2)
        # 2 x 128 rows of 128 bytes over 256 threads: 8 16-byte loads a thread ahead of the wait
        assert compiled.asm["ptx"].split("griddepcontrol.wait")[0].count("ld.global.v4") == 8, readback
        registers[readback] = _registers(compiled)
    assert registers[True] <= 128 < 192 < registers[False], registers


def test_traced_decode_attention_and_merge_stamp_the_clock_around_their_waits():
    """Without a GPU: TRACE (benchmarks.program_trace; kernels/triton/trace.py) in the rule's Llama-3-8B batch-1 split
    plan: the start stamp (and the SM) ahead of the PDL wait and the early tile's loads still there, the release
    and end stamps after it; the same three in the split merge, its next launch still let in first. Without TRACE
    neither register is read, and the attention takes no more registers traced than plain."""
    from tandem.kernels.triton.attention import _launch_plans, _paged_attention_kernel
    plan, = _launch_plans(torch.empty(1, 32, 128, dtype=torch.bfloat16), 4, 1, 8, 1, 2048, kv_bytes=1)
    consts = _decode_attention_consts(BLOCK_Q=plan["BLOCK_M"] // 4, KV_EARLY=True, KV_READBACK=True,
                                      **{k: plan[k] for k in ("BLOCK_M", "BLOCK_N", "NUM_SPLITS")})
    compiled = {}
    for trace in (True, False):
        extra = dict(trace_ptr="*i64") if trace else {}
        compiled[trace] = (_compile_sm90(_paged_attention_kernel, dict(DECODE_ATTENTION_PTRS, **extra),
                                         dict(consts, TRACE=trace), plan["num_warps"], plan["num_stages"]),
                           _compile_merge(NUM_SPLITS=plan["NUM_SPLITS"], TRACE=trace))
    for kernel in compiled[True]:
        ahead, after = kernel.asm["ptx"].split("griddepcontrol.wait")
        assert ahead.count("%globaltimer") == 1 and "%smid" in ahead and after.count("%globaltimer") == 2
    attention, merge = (c.asm["ptx"] for c in compiled[True])
    assert attention.split("griddepcontrol.wait")[0].count("ld.global.v4") == 8  # the early tile: 2 x 128 rows
    assert merge.index("griddepcontrol.launch_dependents") < merge.index("%globaltimer")
    for kernel in compiled[False]:
        assert "%globaltimer" not in kernel.asm["ptx"] and "%smid" not in kernel.asm["ptx"]
    assert _registers(compiled[True][0]) <= _registers(compiled[False][0]) + 8


def _registers(compiled) -> int:
    """Registers a thread of a kernel compiled for sm_90, as `ptxas -v` (the ptxas Triton compiles it with) reports
    them, rounded up to the 8 a thread that an SM allocates them in."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], check=True,
                              capture_output=True, text=True).stderr
    return -(-int(re.search(r"Used (\d+) registers", info).group(1)) // 8) * 8


def _sass(cubin: bytes) -> str:
    """The SASS of a compiled kernel, from the cuobjdump that ships with Triton's NVIDIA backend."""
    import os
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("block_k", [128, None])
def test_fp8_w8a16_plans_compile_for_sm90(block_k):
    """Without a GPU: every W8A16 plan of the Llama-3-8B and Qwen3-30B-A3B projections (fp8 weights
    in the bf16 skinny GEMM, with either pending-norm side) compiles for sm_90 to bf16 tensor-core
    instructions fed by the integer e4m3 conversion (kernels/triton/e4m3.py, as the kernels run on
    CUDA: byte permutes, no cvt), with pipelined (cp.async) weight loads."""
    from tandem.kernels.triton.linear import _skinny_gemm_kernel, w8_scale_kind, w8a16_plans
    ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", out_ptr="*bf16", part_ptr="*fp32", ticket_ptr="*i32",
                res_ptr="*bf16", g_ptr="*bf16", sg_ptr="*bf16", ss_ptr="*fp32", ss_in_ptr="*fp32", eps="fp32",
                ws_ptr="*fp32")
    for plan in w8a16_plans(LLAMA_8B + QWEN3_30B, block_k):
        for norm_out in (False, True):
            p = dict(plan)
            warps, stages = p.pop("num_warps"), p.pop("num_stages")
            consts = dict(BLOCK_M=16, SPLIT_K=p.pop("SPLIT_K"), EVEN_K=True, PRELOAD=p.pop("PRELOAD", True),
                          NORM_OUT=norm_out, NORM_IN=not norm_out, S_PAD=256,
                          W_SCALE=w8_scale_kind(1 if block_k is None else 2, (128, 128), (p["BLOCK_N"], 0)),
                          FAST_CVT=True, PDL=True, **p)
            compiled = _compile_sm90(_skinny_gemm_kernel, ptrs, consts, warps, stages)
            ptx, what = compiled.asm["ptx"], (block_k, plan, norm_out)
            assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx, what
            assert "prmt.b32" in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx, what
            assert "cp.async" in ptx, what
            assert compiled.metadata.shared <= SMEM_LIMIT, (what, compiled.metadata.shared)


def test_assert_codes_match_takes_only_rare_neighbouring_codes():
    """tests/fp8_gpu.py assert_codes_match (a kernel's fp8 codes against torch's): equal codes pass, and so do two one
    code apart with the same sign; a code two apart, a sign flipped, or many codes one apart fail."""
    from tests.fp8_gpu import assert_codes_match
    ref = (torch.randn(64, 512) * 50).to(torch.float8_e4m3fn)
    assert_codes_match(ref.clone(), ref)
    bits = ref.view(torch.uint8).clone()
    i = torch.nonzero((bits & 0x7F) > 2)[:2, :]
    near = bits.clone()
    near[i[:, 0], i[:, 1]] -= 1
    assert_codes_match(near.view(torch.float8_e4m3fn), ref)
    two = bits.clone()
    two[i[0, 0], i[0, 1]] -= 2
    sign = bits.clone()
    sign[i[0, 0], i[0, 1]] ^= 0x80
    many = bits.clone()
    cols = torch.nonzero((bits[0] & 0x7F) > 2)[:10, 0]
    many[0, cols] -= 1
    for bad in (two, sign, many):
        with pytest.raises(AssertionError):
            assert_codes_match(bad.view(torch.float8_e4m3fn), ref)

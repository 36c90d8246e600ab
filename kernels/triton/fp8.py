"""FP8 GEMMs in Triton: y = (x quantized per token (group)) @ (w fp8 with its scales).T, on the
FP8 tensor cores (e4m3 on NVIDIA sm_89+, e4m3fnuz on MI300), for dense layers and MoE experts.

Same contracts and layouts as kernels/fp8.py (fp8_linear_ref, fused_experts_fp8_ref):
  activations: a [M, K] fp8 with a_s [M, G] float32, G = 1 (per token) or ceil(K / bk)
  weights:     w [N, K] fp8 (experts [E, N, K]) with w_s [N] (per channel) or [ceil(N / bn),
               ceil(K / bk)] (block), experts stacked on a leading dim
Block-scaled: each K tile (BLOCK_K divides bk) adds dot(a, w) * a_s[:, kb] * w_s[n // bn, kb] to a
float32 accumulator; per-channel: one dot over K, scaled by a_s * w_s at the end.
Tiles: up to fp8_skinny.MAX_ROWS rows the decode tile of kernels/triton/fp8_skinny.py (narrow N
strips, split K, the activation quantization in the GEMM where its plan says so), above it
torch's FP8 GEMM (_torch_gemm) or the prefill tile here (grouped tile order, plans in
gemm_config). The MoE experts reuse the bf16 kernel's grouping of (token, slot) pairs by expert,
its epilogue and its top-k sum (kernels/triton/moe.py).
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton import fp8_skinny
from tandem.kernels.triton.fp8_skinny import quantize_rows_triton
from tandem.kernels.triton.moe import _align, _sum_topk, gated_scatter_store, moe_gemm_meta
from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _scaled_dot_loop(a_ptrs, w_ptrs, as_ptrs, ws_ptrs, row_mask, n_mask, K, k_tiles_per_group,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr):
    """sum over K of a @ w (a tile [BLOCK_M, BLOCK_K], w tile [BLOCK_K, BLOCK_N], both fp8), each K
    tile times its scales (block) or none (PER_CHANNEL: the caller scales the sum)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = (rk < K - kt * BLOCK_K) | EVEN_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if PER_CHANNEL:
            acc = tl.dot(a, w, acc)
        else:
            kb = kt // k_tiles_per_group
            a_s = tl.load(as_ptrs + kb, mask=row_mask, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_am, stride_asm, stride_wn,
                     stride_wsn, stride_om, rows_per_scale, k_tiles_per_group,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr):
    """out [M, N] = a @ w.T with the scales (module docstring). One program per output tile, in
    groups of GROUP_M row tiles that walk the N tiles together: the programs in flight share
    GROUP_M strips of a and a few of w in L2."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rm < M
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn64[None, :] * stride_wn + rk[:, None]
    as_ptrs = as_ptr + rm64 * stride_asm
    ws_ptrs = ws_ptr + (rn64 // rows_per_scale) * stride_wsn
    acc = _scaled_dot_loop(a_ptrs, w_ptrs, as_ptrs, ws_ptrs, row_mask, n_mask, K, k_tiles_per_group,
                           BLOCK_M, BLOCK_N, BLOCK_K, PER_CHANNEL, EVEN_K)
    if PER_CHANNEL:
        acc *= tl.load(as_ptrs, mask=row_mask, other=0.0)[:, None] * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def gemm_config(m: int, n: int, block_k: int | None) -> dict:
    """Tile plan of the prefill tile (more than fp8_skinny.MAX_ROWS rows; BLOCK_K divides the
    weight's K block): 64-row tiles up to 128 rows; above, 128 x 128 x 128 with 4 stages, 8 warps,
    and 128 x 256 for per-channel weights of wide N (block-scaled keeps 128 x 128: each K step's
    product is held beside the accumulator)."""
    bk = min(128, block_k) if block_k else 128
    if m <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=4, num_stages=4)
    if block_k is None and n >= 8192:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=4)


def _check_block(block: tuple[int, int] | None) -> None:
    if block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
        raise ValueError(f"fp8 Triton GEMM: the weight's K block {block[1]} must be a power of two >= 16")


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
                      cfg: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """kernels.fp8.fp8_linear_ref on the GPU (no bias). x: [M, K] bf16/fp16; w: [N, K] fp8 -> [M, N].
    Up to fp8_skinny.MAX_ROWS rows the decode tile (kernels/triton/fp8_skinny.py; pdl: launched with
    PDL), else torch's FP8 GEMM where _torch_gemm takes the operands, else the prefill tile. cfg: a
    plan of either (SPLIT_K in it: the decode tile's)."""
    _check_block(block)
    m, k = x.shape
    if (cfg is None and fp8_skinny.supports(m, block)) or (cfg is not None and "SPLIT_K" in cfg):
        return fp8_skinny.fp8_skinny_linear_triton(x, w, w_scale, block, cfg, pdl)
    n = w.shape[0]
    if cfg is None and m > 0 and _torch_gemm(x, w, block):
        return _torch_fp8_gemm(x, w, w_scale, block)
    xq, xs = quantize_rows_triton(x, w.dtype, block[1] if block else None)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    cfg = cfg or gemm_config(m, n, block[1] if block else None)
    meta = {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}
    w_scale = w_scale.contiguous()
    grid = (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),)
    _fp8_gemm_kernel[grid](
        xq, xs, w, w_scale, out, m, n, k, xq.stride(0), xs.stride(0), w.stride(0),
        w_scale.stride(0) if block else 1, out.stride(0), block[0] if block else 1,
        block[1] // meta["BLOCK_K"] if block else 1, PER_CHANNEL=block is None,
        EVEN_K=k % meta["BLOCK_K"] == 0, **meta)
    return out


def _torch_gemm(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether prefill rows go to torch's FP8 GEMM, as bf16 prefill goes to cuBLAS: cuBLASLt's
    row-wise _scaled_mm (per-channel) and CUTLASS's 1x128 x 128x128 block-wise scaled_mm ran at
    92-100% and 82-92% of _scaled_mm's speed on an H100 where our prefill tile ran at 78-92% and
    46-53% (at 32-64 decode rows the decode tile beats it: benchmarks/RESULTS.md). CUDA sm_90+
    with K and N multiples of 16; block-wise, of 128 with K / 128 a multiple of 4 (torch wants the
    weight scales' K side padded to 4: "scale_b must have shape 4 x 2" at K 256)."""
    if x.device.type != "cuda" or torch.version.cuda is None or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    n, k = w.shape
    if block is None:
        return n % 16 == 0 and k % 16 == 0
    return (tuple(block) == (128, 128) and n % 128 == 0 and k % 512 == 0
            and hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch.nn.functional, "ScalingType"))


def _torch_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    block: tuple[int, int] | None) -> torch.Tensor:
    """x: [M, K] bf16/fp16, quantized here (per token, or per token and 128 columns); w: [N, K]
    fp8 with w_scale [N] or [N / 128, K / 128] -> [M, N] in x.dtype, by torch's FP8 GEMM (two
    launches: the quantization, the GEMM)."""
    if block is None:
        xq, xs = quantize_rows_triton(x, w.dtype, None)
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, -1).float(), out_dtype=x.dtype)
    F = torch.nn.functional
    m = x.shape[0]
    # rows padded to 128 (cuBLASLt has no block-wise heuristic for some row counts: 65 on an H100)
    # and the scales column-major, as the block-wise kernel reads them: both by the quantization
    xq, xs = quantize_rows_triton(x, w.dtype, block[1], rows=-(-m // 128) * 128, scales_by_column=True)
    out = F.scaled_mm(xq, w.t(), xs, F.ScalingType.BlockWise1x128, w_scale.float().t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out[:m]


def plan_key(m: int, block: tuple[int, int] | None) -> str:
    """Which tile family m rows take (compile-ahead keys its warm-up batches on it)."""
    if fp8_skinny.supports(m, block):
        return f"skinny{fp8_skinny.row_bucket(m)}"
    return "prefill64" if m <= 128 else "prefill128"


@triton.jit
def _fp8_grouped_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, topk_w_ptr,
    N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, num_n_tiles,
    num_experts, rows_per_scale, k_tiles_per_group,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """The bf16 _grouped_gemm_kernel's grouped contract (kernels/triton/moe.py, without its decode
    fusions) on fp8 operands: out[rows] = a[rows] @ w[e].T for one expert block of BLOCK_M rows.
    GATHER_A: row = x[pair // TOP_K]; GATED: w[e] is [gate | up], out = silu(gate) * up;
    SCATTER_OUT: row -> out[pair] * topk_w[pair]. PDL: kernels/triton/pdl.py (the block's expert
    comes from the grouping launch ahead, so nothing is read before the wait)."""
    pid = tl.program_id(0)
    block = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    wait_previous(PDL)
    expert = tl.load(block_expert_ptr + block)
    if (expert < 0) | (expert >= num_experts):
        return
    rm = tl.arange(0, BLOCK_M)
    row_mask = rm < tl.load(block_rows_ptr + block)
    own_row = block.to(tl.int64) * BLOCK_M + rm
    pair = tl.load(sorted_ptr + own_row, mask=row_mask, other=0).to(tl.int64)
    a_row = pair // TOP_K if GATHER_A else own_row
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    rn64 = rn.to(tl.int64)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + rk[None, :]
    as_ptrs = as_ptr + a_row * stride_asm
    w_ptrs = w_ptr + e64 * stride_we + rn64[None, :] * stride_wn + rk[:, None]
    ws_ptrs = ws_ptr + e64 * stride_wse + (rn64 // rows_per_scale) * stride_wsn
    acc = _scaled_dot_loop(a_ptrs, w_ptrs, as_ptrs, ws_ptrs, row_mask, n_mask, K, k_tiles_per_group,
                           BLOCK_M, BLOCK_N, BLOCK_K, PER_CHANNEL, EVEN_K)
    a_s = tl.load(as_ptrs, mask=row_mask, other=0.0)[:, None]
    if PER_CHANNEL:
        acc *= a_s * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    up = acc
    if GATED:
        up_ws = ws_ptr + e64 * stride_wse + ((rn64 + N) // rows_per_scale) * stride_wsn
        up = _scaled_dot_loop(a_ptrs, w_ptrs + N * stride_wn, as_ptrs, up_ws, row_mask, n_mask, K,
                              k_tiles_per_group, BLOCK_M, BLOCK_N, BLOCK_K, PER_CHANNEL, EVEN_K)
        if PER_CHANNEL:
            up *= a_s * tl.load(up_ws, mask=n_mask, other=0.0)[None, :]
    gated_scatter_store(out_ptr, stride_om, acc, up, own_row, pair, row_mask, rn, n_mask, topk_w_ptr,
                        GATED, SCATTER_OUT)


def moe_config(num_pairs: int, num_experts: int, block_k: int | None) -> dict:
    """Tile plan by rows per expert (as kernels/triton/moe.py's), BLOCK_K dividing the K block.
    BLOCK_N1 is the w13 GEMM's N tile, BLOCK_N2 the w2 GEMM's; num_warps1 / num_stages1 / BLOCK_K1
    (2 for w2) may override the shared keys for one GEMM (moe_gemm_meta)."""
    bk = min(128, block_k) if block_k else 128
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N1=128, BLOCK_N2=128, BLOCK_K=bk, num_warps=8, num_stages=3)


def _grouped(a, a_s, w, w_s, out, grouping, block, top_k, meta, gather, gated, scatter, topk_w, pdl):
    """One expert GEMM launch (moe_gemm_meta's meta): a program per (expert block, N tile)."""
    sorted_pairs, block_expert, block_rows, num_blocks = grouping
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    n_tiles = triton.cdiv(n, meta["BLOCK_N"])
    _fp8_grouped_gemm_kernel[(num_blocks * n_tiles,)](
        a, a_s, w, w_s, out, sorted_pairs, block_expert, block_rows, topk_w,
        n, k, a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0),
        w_s.stride(1) if block else 1, out.stride(0), n_tiles, w.shape[0], block[0] if block else 1,
        block[1] // meta["BLOCK_K"] if block else 1,
        TOP_K=top_k, GATHER_A=gather, SCATTER_OUT=scatter, GATED=gated, PER_CHANNEL=block is None,
        EVEN_K=k % meta["BLOCK_K"] == 0, **meta, **launch_args(a, pdl))


def fused_experts_fp8_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, block: tuple[int, int] | None,
    cfg: dict | None = None, pdl: bool = True,
) -> torch.Tensor:
    """kernels.fp8.fused_experts_fp8_ref on the GPU: group the pairs by expert -> quantize x ->
    grouped GEMM w13 + SiLU-mul -> quantize -> grouped GEMM w2 (weighted, per pair) -> top-k sum.
    x: [T, H] -> [T, H] x.dtype. cfg: a plan shaped as moe_config's (benchmarks/fp8_moe.py sweeps
    them), else moe_config's. pdl: the six launches with PDL (kernels/triton/pdl.py)."""
    _check_block(block)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    group = block[1] if block else None
    cfg = cfg or moe_config(num_pairs, num_experts, group)
    meta1, meta2 = moe_gemm_meta(cfg, 1, group), moe_gemm_meta(cfg, 2, group)
    block_m = cfg["BLOCK_M"]
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    grouping = (*_align(topk_ids, num_experts, block_m, num_blocks, pdl), num_blocks)
    xq, xs = quantize_rows_triton(x.contiguous(), w13.dtype, group, pdl)
    act = torch.empty(num_blocks * block_m, inter, device=x.device, dtype=x.dtype)
    _grouped(xq, xs, w13, w13_scale.contiguous(), act, grouping, block, top_k, meta1, True, True, False,
             topk_weights, pdl)
    aq, as_ = quantize_rows_triton(act, w2.dtype, group, pdl, blocks=(grouping[2], block_m))  # real rows only
    pair_out = torch.empty(num_pairs, hidden, device=x.device, dtype=x.dtype)
    _grouped(aq, as_, w2, w2_scale.contiguous(), pair_out, grouping, block, top_k, meta2, False, False, True,
             topk_weights, pdl)
    _sum_topk(pair_out, topk_ids, out, num_experts, min(1024, triton.next_power_of_2(hidden)),
              (out, out, out, out), False, pdl)
    return out

"""FP8 (e4m3) linear layers and MoE experts: quantization helpers, plain-torch references
(dequantize then matmul, with the activations quantized as the kernels quantize them) and the
dispatchers that pick the Triton kernels (kernels/triton/fp8.py) on GPUs with FP8.

Weight layouts (w: [N, K] in the fp8 dtype, scales float32, w ~= w_fp8 * scale), named by
`block` = None or (bn, bk):
  per-channel (block None): w_scale [N]: one scale per output row; activations one per token.
  block (bn, bk):           w_scale [ceil(N / bn), ceil(K / bk)] (bn may be 1: a scale per row
                            and K block); activations one scale per token and group of bk columns.
Experts stack the same per expert: w13 [E, 2I, H] with w13_scale [E, 2I] or [E, 2I/bn, H/bk].
"""
import functools
import logging
from dataclasses import dataclass

import torch

from tandem.kernels.activation import silu_and_mul_ref
from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig
from tandem.kernels.linear import PendingNorm, SplitPartials, decode_rows, can_pend
from tandem.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref

E4M3 = torch.float8_e4m3fn
logger = logging.getLogger(__name__)


@functools.cache
def fp8_dtype(device_type: str = "cuda") -> torch.dtype:
    """The e4m3 variant this platform computes in: float8_e4m3fnuz on MI300 (gfx94x), else the OCP
    float8_e4m3fn (NVIDIA, CPU, MI350)."""
    if device_type == "cuda" and torch.version.hip is not None and torch.cuda.is_available():
        if "gfx94" in torch.cuda.get_device_properties(0).gcnArchName:
            return torch.float8_e4m3fnuz
    return E4M3


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def has_fp8_compute(device: torch.device) -> bool:
    """Whether the GPU has FP8 tensor cores (NVIDIA compute capability >= 8.9, MI300 and newer)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return "gfx94" in arch or "gfx95" in arch
    return torch.cuda.get_device_capability(device) >= (8, 9)


def e4m3fn_to_fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values in e4m3fnuz: its bits read as fnuz are half the value (exponent bias 8, not 7),
    so the scale doubles; the fn pattern 0x80 (-0) is NaN in fnuz and becomes 0."""
    bits = w.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3, group: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization. x: [M, K] -> (x_fp8 [M, K], scale [M, G] float32), G = 1
    (per token) or ceil(K / group) (per token and group of columns); scale = amax / fp8 max."""
    m, k = x.shape
    g = group or k
    pad = (-k) % g
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, g)
    scale = (xf.abs().amax(dim=2) / fp8_max(dtype)).clamp(min=1e-12)
    q = (xf / scale[:, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q.view(m, -1)[:, :k], scale


def quantize_weight(w: torch.Tensor, dtype: torch.dtype = E4M3, block: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., N, K] -> (w_fp8, scale): per output row ([..., N]) or per (bn, bk) block
    ([..., ceil(N/bn), ceil(K/bk)]); scale = amax / fp8 max (the layouts in the module docstring)."""
    n, k = w.shape[-2:]
    bn, bk = block or (1, k)
    wf = torch.nn.functional.pad(w.float(), (0, (-k) % bk, 0, (-n) % bn))
    blocks = wf.view(*w.shape[:-2], wf.shape[-2] // bn, bn, wf.shape[-1] // bk, bk)
    scale = (blocks.abs().amax(dim=(-3, -1)) / fp8_max(dtype)).clamp(min=1e-12)
    q = (blocks / scale[..., :, None, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    q = q.view(wf.shape)[..., :n, :k].contiguous()
    return q, (scale if block else scale[..., 0])


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """w: [..., N, K] fp8; scale [..., N] (block None) or [..., Nb, Kb] -> [..., N, K] float32."""
    n, k = w.shape[-2:]
    if block is None:
        return w.float() * scale[..., None].float()
    full = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w.float() * full[..., :n, :k]


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32); w: [N, K] fp8; w_scale and block per the module docstring ->
    [..., N] in x.dtype. x is quantized dynamically (per token, or per token and K block) like the
    kernels do, then both sides are dequantized and multiplied in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2, w.dtype, block[1] if block else None)
    return _quantized_linear_ref(xq, xs, w, w_scale, block, bias, x.dtype).view(*x.shape[:-1], w.shape[0])


def _quantized_linear_ref(xq, xs, w, w_scale, block, bias, dtype) -> torch.Tensor:
    """Rows quantized as quantize_rows writes them (xq [M, K], xs [M, G]) @ the dequantized w.T -> [M, N] dtype."""
    k = xq.shape[1]
    xd = xq.float() * xs.repeat_interleave(block[1] if block else k, dim=1)[:, :k]
    y = xd @ dequantize_weight(w, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


@dataclass
class QuantRows:
    """An FP8 GEMM's input rows written quantized by the kernel that produced them (the RMSNorm,
    attention or SiLU-and-mul ahead; KernelConfig.fuse_fp8_quant): q [T, K] fp8 and s [T, ceil(K / group)] float32
    as quantize_rows writes them, for rows of `dtype`; the GEMM skips its own quantization launch."""
    q: torch.Tensor
    s: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quant_ahead(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None,
                config: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.dtype, int] | None:
    """(fp8 dtype, group) where fp8_linear on x's rows [T, K] would quantize them in a launch of its
    own ahead of the FP8 decode GEMM: config.fuse_fp8_quant, block-scaled, 17..MAX_ROWS rows (below,
    the decode paths carry the norms: PendingNorm), bf16/fp16 rows on a GPU with FP8, a plan that
    does not quantize in the GEMM; or at 1..16 rows where the TMA GEMM's ring form takes them (tma_ring)
    and the o projection's TMA GEMM does not. Then the kernel producing x writes it quantized (QuantRows). On
    the CPU the same rule picks the references' fused forms, which compute the very same values."""
    from tandem.kernels.triton.linear import MAX_ROWS as NORM_ROWS
    if x.dim() == 2 and 0 < x.shape[0] <= NORM_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        ring = block is not None and tma_ring(x, w, block, config) and not _tma_gemm(x, w, block, config)
        return (w.dtype, block[1]) if ring else None
    if not (config.fuse_fp8_quant and block is not None and x.dim() == 2 and x.shape[0] > NORM_ROWS
            and block[1] <= 1024 and not block[1] & (block[1] - 1)):
        return None
    if x.device.type != "cpu" and not (use_triton(x) and has_fp8_compute(x.device)
                                       and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    from tandem.kernels.triton.fp8_skinny import supports
    if w.shape[1] != x.shape[1] or not supports(x.shape[0], block) or _quantizes_in_gemm(x, w, block):
        return None
    return w.dtype, block[1]


def rms_norm_quant_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize_rows(rms_norm(x (+ residual))) -> (q, s, x + residual or None): the fused kernel's contract."""
    if residual is None:
        normed, summed = rms_norm_ref(x, weight, eps), None
    else:
        normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
    return *quantize_rows(normed, dtype, group), summed


def silu_and_mul_quant_ref(x: torch.Tensor, dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu_and_mul(x)) -> (q, s): the fused kernel's contract."""
    return quantize_rows(silu_and_mul_ref(x), dtype, group)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype, group: int, config: KernelConfig = DEFAULT_KERNELS
                   ) -> tuple[QuantRows, torch.Tensor | None]:
    """RMSNorm (with the residual add) writing the next FP8 GEMM's quantized input -> (QuantRows, the sum)."""
    if use_triton(x):
        from tandem.kernels.triton.norm import rms_norm_quant_triton
        q, s, summed = rms_norm_quant_triton(x, residual, weight, eps, dtype, group, config.pdl)
    else:
        q, s, summed = rms_norm_quant_ref(x, residual, weight, eps, dtype, group)
    normed_from = x if summed is None else summed  # the row the norm scales, in the sum's dtype
    return QuantRows(q, s, group, torch.promote_types(normed_from.dtype, weight.dtype)), summed


def silu_and_mul_quant(x: torch.Tensor, dtype: torch.dtype, group: int,
                       config: KernelConfig = DEFAULT_KERNELS) -> QuantRows:
    """SiLU-and-mul writing the next FP8 GEMM's quantized input; at decode sizes (<= 16 rows, where quant_ahead asks
    for quantized rows only for the TMA GEMM's ring form) it lets that GEMM in early with config.fp8_tma_ring_early."""
    if use_triton(x):
        from tandem.kernels.triton.activation import silu_and_mul_quant_triton
        from tandem.kernels.triton.linear import MAX_ROWS
        early = config.fp8_tma_ring_early and x.reshape(-1, x.shape[-1]).shape[0] <= MAX_ROWS
        q, s = silu_and_mul_quant_triton(x, dtype, group, config.pdl, early)
    else:
        q, s = silu_and_mul_quant_ref(x, dtype, group)
    return QuantRows(q, s, group, x.dtype)


def fp8_linear_w8a16_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A16 decode path's contract (KernelConfig.fp8_dense_w8a16): x unquantized times the
    dequantized weight, in float32 -> [..., N] in x.dtype. Shapes as fp8_linear_ref."""
    y = x.float() @ dequantize_weight(w, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_decode_rows(x: torch.Tensor, block: tuple[int, int] | None, config: KernelConfig = DEFAULT_KERNELS,
                    moe: bool = False) -> int:
    """x's row count where the decode path reads fp8 weights into the bf16 decode kernels (W8A16:
    a GPU with FP8, <= 16 rows of bf16/fp16, a K block that K tiles can divide (a power of two >=
    16); the routed MoE experts with config.fp8_moe_w8a16, the skinny GEMM with
    config.fp8_dense_w8a16), else 0."""
    if not ((config.fp8_moe_w8a16 if moe else config.fp8_dense_w8a16) and has_fp8_compute(x.device)):
        return 0
    if block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
        return 0
    return decode_rows(x, config)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """fp8_linear_ref's contract; the Triton FP8 GEMM on GPUs with FP8 (config.pdl: the decode tile
    launched with PDL), else the reference (a GPU without FP8 runs the reference too: dequantize
    then matmul). At decode sizes with config.fp8_dense_w8a16: fp8_linear_w8a16_ref's contract, on
    the bf16 skinny GEMM reading the fp8 weight. x may be QuantRows (quant_ahead): no quantization here; or
    SplitPartials (takes_partials), merged first here."""
    if isinstance(x, SplitPartials):
        x = x.merged()
    if isinstance(x, QuantRows):
        if x.group != (block[1] if block else None) or x.q.dtype != w.dtype:
            raise ValueError(f"fp8_linear: rows quantized in groups of {x.group} ({x.q.dtype}) for a weight "
                             f"with block {block} ({w.dtype})")
        if tma_ring(x.q, w, block, config):
            from tandem.kernels.triton.fp8_tma import fp8_tma_ring_linear
            y = fp8_tma_ring_linear(x.q, x.s, w, w_scale, x.dtype, pdl=config.pdl)[0]
        elif use_triton(x.q) and has_fp8_compute(x.q.device):
            from tandem.kernels.triton.fp8_skinny import fp8_skinny_linear_triton
            y = fp8_skinny_linear_triton(x.q, w, w_scale, block, pdl=config.pdl, quantized=x.s, dtype=x.dtype)
        else:
            y = _quantized_linear_ref(x.q, x.s, w, w_scale, block, None, x.dtype)
        return y if bias is None else y + bias
    rows = fp8_decode_rows(x, block, config)
    if rows:
        from tandem.kernels.triton.linear import skinny_linear_triton
        y = skinny_linear_triton(x.reshape(rows, x.shape[-1]), w, pdl=config.pdl, w_scale=w_scale,
                                 block=block, int_convert=config.fp8_int_convert).view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    if use_triton(x) and has_fp8_compute(x.device):
        from tandem.kernels.triton.fp8 import fp8_linear_triton
        y = fp8_linear_triton(x.reshape(-1, x.shape[-1]), w, w_scale, block, pdl=config.pdl).view(
            *x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    return fp8_linear_ref(x, w, w_scale, block, bias)


def _quantizes_in_gemm(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether the Triton decode GEMM's plan for x @ w.T quantizes x in the GEMM (no launch ahead of it)."""
    from tandem.kernels.triton.device import num_sms
    from tandem.kernels.triton.fp8_skinny import plan
    return plan(x.shape[0], w.shape[0], w.shape[1], block[1] if block else None, num_sms(x.device))["QUANT"]


def _decode_tile(x: torch.Tensor, block: tuple[int, int] | None, config: KernelConfig) -> bool:
    """Whether x's rows may leave / take a pending RMSNorm on the FP8 decode tile (a GPU with FP8,
    config.fuse_norms, <= 16 rows of bf16/fp16, a K block the tile takes)."""
    if not (can_pend(x, config) and has_fp8_compute(x.device)):
        return False
    from tandem.kernels.triton.fp8_skinny import supports
    return supports(x.shape[0], block)


TMA_MIN_BYTES = 12 << 20


@functools.cache
def _gluon_hopper() -> bool:
    """Whether this Triton has Gluon's Hopper pieces (3.5 and up); without them the Triton decode GEMM runs."""
    try:
        from tandem.kernels.triton import fp8_tma  # noqa: F401
    except ImportError as e:
        logger.info("FP8 TMA decode GEMM off: %s", e)
        return False
    return True


def _tma_device(x: torch.Tensor) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (TMA, wgmma), and a Triton that builds for it in Gluon."""
    return (x.is_cuda and torch.version.cuda is not None and torch.cuda.get_device_capability(x.device)[0] >= 9
            and _gluon_hopper())


def _tma_gemm(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None, config: KernelConfig) -> bool:
    """Whether the o projection x @ w.T (ahead of a pending norm) runs on the Gluon TMA decode GEMM:
    config.fp8_tma_gemm, a weight of TMA_MIN_BYTES or more (more than HBM streams during the attention's split
    merge alone, ~2 us or ~9 MB on an H200, so that letting it in early pays: tma_early), such a GPU, a shape
    kernels/triton/fp8_tma.py takes. In the decode step on an H200 (benchmarks/RESULTS.md): Llama-3-8B's o (16 MiB)
    2.707 -> 2.609 ms at b=1 and 3.621 -> 3.564 at b=16 with the early launch; Qwen3-30B-A3B's (8 MiB) 2.395 ->
    2.383 at b=1 but 6.647 -> 6.833 at b=16, so it keeps the Triton GEMM."""
    if not (config.fp8_tma_gemm and w.numel() * w.element_size() >= TMA_MIN_BYTES and _tma_device(x)):
        return False
    from tandem.kernels.triton import fp8_tma
    return fp8_tma.supports(x, w, block)


def tma_early(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None,
              config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether the kernel producing x (the attention's split merge) lets the TMA decode GEMM of x @ w.T in before
    its own PDL wait (config.fp8_tma_early), so its weight streams in while the attention runs: wherever that GEMM
    runs (_tma_gemm)."""
    return config.fp8_tma_early and _tma_gemm(x, w, block, config)


def takes_partials(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None,
                   config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether one token's decode attention ahead of x @ w.T (the o projection ahead of a pending norm) hands over
    its split-K partials for the TMA decode GEMM to merge (config.fp8_tma_gemm and fp8_tma_merge; one row; such a
    GPU; a shape the GEMM takes, of any size: with no merge launch between, the weight streams during the
    attention itself), instead of the merge launch writing x for the ring form; not where the merge launch lets
    the TMA GEMM in early (tma_early), where merging in every program costs more than that launch. In the decode
    step on an H200 (benchmarks/RESULTS.md): Qwen3-30B-A3B (o on the ring without it) 2.036 -> 2.020 ms at b=1;
    Llama-3-8B (o early on the TMA GEMM without it) 2.536 -> 2.678, so it keeps the merge launch."""
    if not (config.fp8_tma_gemm and config.fp8_tma_merge and x.shape[0] == 1 and _decode_tile(x, block, config)
            and _tma_device(x)) or tma_early(x, w, block, config):
        return False
    from tandem.kernels.triton import fp8_tma
    return fp8_tma.supports(x, w, block)


def tma_ring(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None,
             config: KernelConfig = DEFAULT_KERNELS, normed: bool = False) -> bool:
    """Whether x's rows [M, K], quantized ahead, @ w.T run on the ring form of the Gluon TMA decode GEMM
    (kernels/triton/fp8_tma.py fp8_tma_ring_linear): config.fp8_tma_ring (normed: config.fp8_tma_ring_normed, x
    a pending norm's rows), such a GPU (_tma_device), a shape the ring takes."""
    if not ((config.fp8_tma_ring_normed if normed else config.fp8_tma_ring) and x.dim() == 2 and _tma_device(x)):
        return False
    from tandem.kernels.triton import fp8_tma
    return fp8_tma.ring_supports(x.shape[0], w, block, x.device)


def ring_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: tuple, top_k: int,
                 config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether x's routed experts (every one held here) run on the ring form (routed_experts_ring):
    config.fp8_tma_ring_moe, such a GPU (_tma_device), one token, scales = (w13_scale, w2_scale, block) laid out
    [E, 2I / 128, H / 128] and [E, H / 128, I / 128], shapes the ring takes (fp8_tma.ring_experts_supports)."""
    if not (config.fp8_tma_ring_moe and x.dim() == 2 and _tma_device(x)):
        return False
    from tandem.kernels.triton import fp8_tma
    (e, two_i, h), (s13, s2, block) = w13.shape, scales
    return (fp8_tma.ring_experts_supports(x.shape[0], w13, w2, block, top_k, x.device)
            and tuple(s13.shape) == (e, two_i // 128, h // 128) and tuple(s2.shape) == (e, h // 128, two_i // 256))


def ring_router(x: torch.Tensor, gate: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether, where ring_experts holds, the ring's routing launch also runs x's router GEMM against the router
    weight gate [E, K] (config.fp8_tma_ring_moe_route; routing.route_token_supports: a bf16/fp16 weight)."""
    from tandem.kernels.triton.routing import route_token_supports
    return config.fp8_tma_ring_moe_route and route_token_supports(x, gate)


def fold_router(x: torch.Tensor, gate: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether, where ring_experts and ring_router hold for one token x, the GEMM ahead that leaves the norm
    before them pending may run their router GEMM in partials instead (fp8_linear_add_norm's router;
    config.fp8_tma_ring_moe_fold with fp8_tma_ring_moe_rank and fp8_sg_quant, a contiguous gate)."""
    return (config.fp8_tma_ring_moe_fold and config.fp8_tma_ring_moe_rank and config.fp8_sg_quant
            and x.shape[0] == 1 and gate.is_contiguous() and ring_router(x, gate, config))


def routed_experts_ring(x: torch.Tensor, router_logits: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                        top_k: int, renormalize: bool, scoring: str, norm_in: tuple | None, norm_out: tuple | None,
                        scales: tuple, config: KernelConfig = DEFAULT_KERNELS, gate: torch.Tensor | None = None,
                        quant: tuple[torch.dtype, int] | None = None, ahead: tuple | None = None):
    """kernels.moe.routed_experts on the ring form (ring_experts), then fp8_tma_ring_experts. router_logits None
    (ring_router): the router GEMM against gate, the top-k and x's row quantized in one launch
    (route_token_triton), whose ids w13 waits for (config.fp8_tma_ring_moe_rank: its logits, which w13's and w2's
    programs rank themselves, no ticket between); else the routing launch, then x's row quantized (not early:
    w13 reads the ids, complete by then, before its wait). norm_in / norm_out as routed_experts takes them; quant
    (with norm_out): the next FP8 GEMM's (dtype, group) for its input, the pending norm's sg (_sg_quant), then
    returned quantized too: (s, sg, ss, QuantRows). ahead = (partials [strips, E], QuantRows), with gate and norm_in:
    the router GEMM in partial sums and x's row quantized, left by the o projection ahead (fp8_linear_add_norm's
    router), which w13's and w2's programs sum and rank: no routing launch."""
    from tandem.kernels.triton.fp8_tma import fp8_tma_ring_experts
    ranked = None
    if ahead is not None and router_logits is None and norm_in is not None:
        partials, rows = ahead
        xq, xs, weights, ids = rows.q, rows.s, None, None
        ranked = (partials, top_k, renormalize, scoring)
    elif router_logits is None:
        from tandem.kernels.triton.routing import route_token_triton
        rank_here = not config.fp8_tma_ring_moe_rank  # else the logits alone, which the experts' programs rank
        routed, ids, xq, xs = route_token_triton(x, gate, top_k, renormalize, scoring, w13.dtype, norm_in, config.pdl,
                                                 rank=rank_here)
        weights, ranked = (routed, None) if rank_here else (None, (routed, top_k, renormalize, scoring))
    else:
        from tandem.kernels.triton.fp8_skinny import quantize_rows_triton
        from tandem.kernels.triton.routing import topk_routing_triton
        weights, ids = topk_routing_triton(router_logits, top_k, renormalize, scoring, config.pdl)
        xq, xs = quantize_rows_triton(x, w13.dtype, 128, config.pdl)
    residual, norm_weight = norm_out if norm_out is not None else (None, None)
    bufs = _sg_quant(quant, x.shape[0], w2.shape[1], x.device, config) if norm_out is not None else None
    if _fused_experts(ranked, w13, top_k, config):
        from tandem.kernels.triton.fp8_tma_moe import fp8_tma_fused_experts
        out, sg, ss = fp8_tma_fused_experts(xq, xs, w13, scales[0], w2, scales[1], ranked[0], top_k, renormalize,
                                            x.dtype, norm_in, residual, norm_weight, config.pdl, bufs)
    else:
        out, sg, ss = fp8_tma_ring_experts(xq, xs, w13, scales[0], w2, scales[1], ids, weights, x.dtype, norm_in,
                                           residual, norm_weight, config.pdl, config.fp8_tma_ring_early,
                                           ids_late=router_logits is None, silu_out=config.fp8_tma_ring_moe_silu,
                                           sg_quant=bufs, ranked=ranked)
    if norm_out is None:
        return out
    return (out, sg, ss) if bufs is None else (out, sg, ss, _sg_rows(bufs, sg))


def _fused_experts(ranked: tuple | None, w13: torch.Tensor, top_k: int, config: KernelConfig) -> bool:
    """Whether routed_experts_ring's experts run as one persistent launch (kernels/triton/fp8_tma_moe.py):
    config.fp8_tma_ring_moe_fused, the router logits of one token ranked by the experts at softmax scoring, a shape
    it takes."""
    if not (config.fp8_tma_ring_moe_fused and ranked is not None and ranked[0].dim() == 1 and ranked[3] == "softmax"):
        return False
    from tandem.kernels.triton.fp8_tma_moe import fused_supports
    e, two_i, h = w13.shape
    return fused_supports(h, two_i // 2, top_k, e)


def _sg_quant(spec: tuple[torch.dtype, int] | None, m: int, n: int, device: torch.device,
              config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Buffers for a Gluon decode GEMM with a pending norm out to write its sg quantized as well (QUANT_SG), where
    the next FP8 GEMM would quantize sg in a launch of its own in those groups (spec: its (dtype, group),
    quant_ahead's answer; a pending norm's consumer takes the ring only with config.fp8_tma_ring_normed) and
    config.fp8_sg_quant; else None."""
    if not (config.fp8_sg_quant and config.fp8_tma_ring_normed and spec == (torch.float8_e4m3fn, 128)):
        return None
    from tandem.kernels.triton.fp8_tma import sg_quant_buffers
    return sg_quant_buffers(m, n, device)


def _sg_rows(bufs: tuple[torch.Tensor, torch.Tensor] | None, sg: torch.Tensor) -> "QuantRows | None":
    """The rows _sg_quant's buffers hold once the GEMM wrote them (None without buffers)."""
    if bufs is None:
        return None
    q, s = bufs
    return QuantRows(q, s[:q.shape[0]], 128, sg.dtype)


def fp8_linear_add_norm(x: torch.Tensor | QuantRows, w: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int] | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        config: KernelConfig = DEFAULT_KERNELS, quant: tuple[torch.dtype, int] | None = None,
                        router: tuple[torch.Tensor, tuple[torch.dtype, int]] | None = None) -> PendingNorm | None:
    """kernels.linear.linear_add_norm with an fp8 weight: x @ w.T + residual with the RMSNorm after
    it left pending, in one launch of the FP8 decode GEMM; None (nothing run) where that does not
    apply. x: [T, K] (QuantRows: on the TMA GEMM's ring form, tma_ring; SplitPartials: on the TMA GEMM, which
    merges them, takes_partials); w: [N, K] fp8; residual: [T, N]; norm_weight: [N]. quant: the next FP8 GEMM's
    (dtype, group) where it would quantize its input in a launch of its own (quant_ahead): the Gluon GEMMs then
    write sg quantized too, the PendingNorm's quant (_sg_quant). router = (gate [E, N], the ring experts' (dtype,
    group)) where the ring experts after route one token themselves (fold_router): on the TMA GEMM at one row
    with sg quantized, the router GEMM's partials too, the PendingNorm's router (fp8_tma_linear's router)."""
    def gluon(run, fold: bool = False) -> PendingNorm:  # a Gluon GEMM, run(sg_quant buffers, router) -> (s, sg, ss)
        gate, spec = router if fold and router is not None and residual.shape[0] == 1 else (None, quant)
        bufs = _sg_quant(spec, *residual.shape, residual.device, config)
        plog = None
        if gate is not None and bufs is not None:
            plog = torch.empty(residual.shape[1] // 128, gate.shape[0], device=gate.device, dtype=torch.float32)
        s, sg, ss = run(bufs, None if plog is None else (gate, plog))
        return PendingNorm(s, sg, ss, norm_weight, eps, _sg_rows(bufs, sg), plog)

    if isinstance(x, SplitPartials):
        if not (takes_partials(x.rows, w, block, config) and norm_weight.dtype == residual.dtype == x.dtype):
            return None
        from tandem.kernels.triton.fp8_tma import fp8_tma_linear
        return gluon(lambda b, r: fp8_tma_linear(x, w, w_scale, residual, norm_weight, pdl=config.pdl, sg_quant=b,
                                                 router=r), fold=True)
    if isinstance(x, QuantRows):
        if not (tma_ring(x.q, w, block, config) and x.group == block[1] and x.q.dtype == w.dtype
                and norm_weight.dtype == residual.dtype == x.dtype and config.fuse_norms):
            return None
        from tandem.kernels.triton.fp8_tma import fp8_tma_ring_linear
        return gluon(lambda b, _: fp8_tma_ring_linear(x.q, x.s, w, w_scale, x.dtype, residual, norm_weight,
                                                      pdl=config.pdl, sg_quant=b))
    if not (_decode_tile(x, block, config) and norm_weight.dtype == residual.dtype == x.dtype):
        return None
    if _tma_gemm(x, w, block, config):
        from tandem.kernels.triton.fp8_tma import fp8_tma_linear
        return gluon(lambda b, r: fp8_tma_linear(x, w, w_scale, residual, norm_weight, pdl=config.pdl, sg_quant=b,
                                                 router=r), fold=True)
    if fp8_decode_rows(x, block, config):
        from tandem.kernels.triton.linear import skinny_linear_add_norm_triton
        s, sg, ss = skinny_linear_add_norm_triton(x, w, residual, norm_weight, pdl=config.pdl, w_scale=w_scale,
                                                  block=block, int_convert=config.fp8_int_convert)
        return PendingNorm(s, sg, ss, norm_weight, eps)
    from tandem.kernels.triton.fp8_skinny import fp8_skinny_add_norm_triton
    s, sg, ss = fp8_skinny_add_norm_triton(x, w, w_scale, block, residual, norm_weight, pdl=config.pdl)
    return PendingNorm(s, sg, ss, norm_weight, eps)


def fp8_linear_normed(p: PendingNorm, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
                      bias: torch.Tensor | None = None, config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """rms_norm(p.s) @ w.T (+ bias) with an fp8 weight: the FP8 decode GEMM on p.sg scaled by each
    row's 1/rms (no norm launch), else the norm then fp8_linear."""
    if not (_decode_tile(p.sg, block, config) and p.ss.shape[0] == 16):
        return fp8_linear(p.normed(config), w, w_scale, block, bias, config)
    # the ring with a quantization launch ahead even where the Triton plan quantizes in the GEMM (the 8B and 30B
    # qkv): on an H200 the Llama-3-8B b=1 step 2.602 -> 2.575 ms, Qwen3-30B-A3B 2.398 -> 2.334 (RESULTS.md)
    if tma_ring(p.sg, w, block, config, normed=True):
        from tandem.kernels.triton.fp8_skinny import quantize_rows_triton
        from tandem.kernels.triton.fp8_tma import fp8_tma_ring_linear
        q = p.quant
        if q is not None and q.q.dtype == w.dtype and q.group == block[1] and q.q.shape == p.sg.shape:
            xq, xs = q.q, q.s  # written by the GEMM ahead (fp8_sg_quant): no quantization launch
        else:
            xq, xs = quantize_rows_triton(p.sg, w.dtype, block[1], config.pdl, early=config.fp8_tma_ring_early)
        y = fp8_tma_ring_linear(xq, xs, w, w_scale, p.sg.dtype, norm_in=(p.ss, p.eps), pdl=config.pdl)[0]
        return y if bias is None else y + bias
    if fp8_decode_rows(p.sg, block, config):
        from tandem.kernels.triton.linear import skinny_linear_normed_triton
        y = skinny_linear_normed_triton(p.sg, w, p.ss, p.eps, pdl=config.pdl, w_scale=w_scale, block=block,
                                        int_convert=config.fp8_int_convert)
    else:
        from tandem.kernels.triton.fp8_skinny import fp8_skinny_normed_triton
        y = fp8_skinny_normed_triton(p.sg, w, w_scale, block, p.ss, p.eps, pdl=config.pdl)
    return y if bias is None else y + bias


def fused_experts_fp8_ref(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, block: tuple[int, int] | None,
) -> torch.Tensor:
    """kernels.moe.fused_experts_ref with fp8 experts: x [T, H]; w13 [E, 2I, H], w2 [E, H, I] fp8
    with their scales (module docstring). Each expert GEMM is fp8_linear_ref. -> [T, H] x.dtype."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = silu_and_mul_ref(fp8_linear_ref(x[token_idx], w13[e], w13_scale[e], block))
        h = fp8_linear_ref(h, w2[e], w2_scale[e], block)
        w = topk_weights[token_idx, slot].to(x.dtype)
        out.index_add_(0, token_idx, (h * w[:, None]).float())
    return out.to(x.dtype)


def fused_experts_fp8(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, block: tuple[int, int] | None,
    config: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """fused_experts_fp8_ref's contract; the Triton FP8 grouped GEMMs on GPUs with FP8 (launched
    with PDL unless config.pdl is off)."""
    if use_triton(x) and has_fp8_compute(x.device):
        from tandem.kernels.triton.fp8 import fused_experts_fp8_triton
        return fused_experts_fp8_triton(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                                        block, pdl=config.pdl)
    return fused_experts_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block)

"""MoE router top-k and fused experts.

Expert weights (one tensor per projection, experts stacked):
  w13: [num_experts, 2 * intermediate, hidden]   rows laid out as [gate | up]
  w2:  [num_experts, hidden, intermediate]
"""
import torch

from tandem.kernels.activation import silu_and_mul_ref
from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig


def topk_routing_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    if scoring == "softmax":
        scores = router_logits.float().softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        raise ValueError(f"unknown MoE scoring function {scoring!r}; expected 'softmax' or 'sigmoid'")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
    config: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(router_logits):
        from tandem.kernels.triton.routing import topk_routing_triton
        return topk_routing_triton(router_logits, top_k, renormalize, scoring, config.pdl)
    return topk_routing_ref(router_logits, top_k, renormalize, scoring)


def fused_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, H]; topk_ids index dim 0 of w13/w2 (negative ids are skipped: experts owned
    elsewhere). Returns sum_k weight_k * expert_k(x): [T, H] in x.dtype."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = silu_and_mul_ref(x[token_idx] @ w13[e].t()) @ w2[e].t()
        w = topk_weights[token_idx, slot].to(x.dtype)
        out.index_add_(0, token_idx, (h * w[:, None]).float())
    return out.to(x.dtype)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, config: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    if use_triton(x):
        from tandem.kernels.triton.moe import fused_experts_triton
        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, config.pdl)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)


def routed_experts(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, scoring: str = "softmax", norm_in: tuple[torch.Tensor, float] | None = None,
    norm_out: tuple[torch.Tensor, torch.Tensor] | None = None, config: KernelConfig = DEFAULT_KERNELS,
    scales: tuple | None = None, gate: torch.Tensor | None = None, quant: tuple[torch.dtype, int] | None = None,
    ahead: tuple | None = None,
):
    """topk_routing then fused_experts, every expert held here (no expert parallelism); on a GPU
    at decode sizes the routing happens inside the first expert GEMM. GPU only: norm_in = (ss,
    eps), x is a pending norm's s * weight; norm_out = (residual, norm weight), returns (s, sg,
    ss) of the next norm left pending (kernels.linear.PendingNorm). scales = (w13_scale,
    w2_scale, block): fp8 experts (kernels/fp8.py layouts) on the same kernels, their weights
    converted to x's dtype (W8A16), or for one token on a Hopper GPU the TMA ring (kernels.fp8.ring_experts);
    the reference multiplies the dequantized weights. router_logits None: gate, the router weight, whose GEMM
    the ring's routing launch runs (the caller checked kernels.fp8.ring_experts and ring_router). quant (with
    norm_out, on the ring): the next FP8 GEMM's input (dtype, group), then also returned quantized: (s, sg, ss,
    QuantRows) (kernels.fp8.routed_experts_ring). ahead = (router partials, QuantRows) with gate and norm_in: the
    GEMM ahead ran the router GEMM in partials and quantized x (kernels.linear.PendingNorm's router and quant)."""
    if use_triton(x):
        from tandem.kernels.fp8 import ring_experts, routed_experts_ring
        if gate is not None or (scales is not None and ring_experts(x, w13, w2, scales, top_k, config)):
            return routed_experts_ring(x, router_logits, w13, w2, top_k, renormalize, scoring, norm_in, norm_out,
                                       scales, config, gate, quant, ahead)
        from tandem.kernels.triton.moe import routed_experts_triton
        return routed_experts_triton(x, router_logits, w13, w2, top_k, renormalize, scoring, norm_in, norm_out,
                                     config.pdl, scales, config.fp8_int_convert)
    if norm_in is not None or norm_out is not None:
        raise ValueError("routed_experts: a pending norm needs the Triton experts")
    if scales is not None:
        from tandem.kernels.fp8 import dequantize_weight
        w13, w2 = (dequantize_weight(w, s, scales[2]).to(x.dtype) for w, s in ((w13, scales[0]), (w2, scales[1])))
    weights, ids = topk_routing_ref(router_logits, top_k, renormalize, scoring)
    return fused_experts_ref(x, w13, w2, weights, ids)

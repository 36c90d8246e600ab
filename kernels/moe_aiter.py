"""Fused MoE experts through AITER (ROCm only), same contract as kernels.moe.fused_experts.

Written against AITER's published Python API (`aiter.fused_moe.fused_moe`,
`aiter.ops.shuffle.shuffle_weight`); untested here: there is no ROCm hardware in this
project's CI or device pool. Imported lazily; asking for it without ROCm + aiter is a clear error.
"""
import torch

from tandem.kernels.backend import require_rocm_package, rocm_package_available


def aiter_available() -> bool:
    return rocm_package_available("aiter")


def require_aiter() -> None:
    require_rocm_package("aiter", "--moe-experts aiter", "triton or torch")


def shuffle_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER's CK kernels read expert weights in a (16, 16)-tiled layout."""
    from aiter.ops.shuffle import shuffle_weight
    return shuffle_weight(w13, layout=(16, 16)), shuffle_weight(w2, layout=(16, 16))


def fused_experts_aiter(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """w13/w2 already shuffled. Negative ids (experts on other EP ranks) go to one extra expert
    id that AITER's expert_mask switches off."""
    from aiter import ActivationType, QuantType
    from aiter.fused_moe import fused_moe

    num_local = w13.shape[0]
    mask = None
    if topk_ids.numel() and bool((topk_ids < 0).any()):
        topk_ids = torch.where(topk_ids < 0, torch.full_like(topk_ids, num_local), topk_ids)
        mask = torch.ones(num_local + 1, dtype=torch.int32, device=x.device)
        mask[num_local] = 0
    return fused_moe(x, w13, w2, topk_weights, topk_ids, expert_mask=mask, activation=ActivationType.Silu,
                     quant_type=QuantType.No)

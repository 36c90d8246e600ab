"""Expert-parallel dispatch/combine backends behind one contract.

dispatch(x, topk_weights, topk_ids) -> (x', weights', ids', handle): move each token
to the ranks that own its experts, with ids rewritten to local expert indices
(negative where the expert lives elsewhere); combine(y, handle) -> y: bring the
expert outputs back to the tokens' home ranks, summed.
"""
from typing import Any, Protocol

import torch


class DispatchCombine(Protocol):
    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


class NoDispatch:
    """All experts are local: nothing moves."""

    def dispatch(self, x, topk_weights, topk_ids):
        return x, topk_weights, topk_ids, None

    def combine(self, y, handle):
        return y


BACKENDS = ("none", "naive", "a2a", "mori")


def make_dispatcher(backend: str, group=None, num_experts: int = 0, placement: str = "linear") -> DispatchCombine:
    """backend: none | naive | a2a | mori. group: the expert-parallel process group."""
    if backend == "none":
        return NoDispatch()
    if backend not in BACKENDS:
        raise ValueError(f"unknown all2all backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "mori":
        raise ValueError("the mori all2all backend needs ROCm with MoRI-EP installed; use naive or a2a")
    import torch.distributed as dist

    from kernels.ep.placement import expert_owner_map
    owner, local = expert_owner_map(num_experts, dist.get_world_size(group), placement)
    if backend == "naive":
        from kernels.ep.naive import NaiveDispatch
        return NaiveDispatch(group, owner, local)
    from kernels.ep.a2a import AllToAllDispatch
    return AllToAllDispatch(group, owner, local)

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


def make_dispatcher(backend: str) -> DispatchCombine:
    if backend == "none":
        return NoDispatch()
    raise ValueError(f"all2all backend {backend!r} is not available; expected one of: none")

"""Expert-parallel dispatch/combine backends behind one contract.

dispatch(x, topk_weights, topk_ids) -> (x', weights', ids', handle): move each token
to the ranks that own its experts, with ids rewritten to local expert indices
(negative where the expert lives elsewhere); combine(y, handle) -> y: bring the
expert outputs back to the tokens' home ranks, summed.

  x: [T, H]; topk_weights: [T, k] float32; topk_ids: [T, k] int32 global expert ids.
  x', weights', ids': the rows this rank's experts run over (backend-specific count);
  y: the experts' output for x' rows; combine returns [T, H] in y.dtype.

Backends: none (all experts local), local (EP inside a TP group: every rank holds the same
tokens, the caller all-reduces), naive (all-gather / reduce-scatter), a2a (all_to_all_single
with exact splits), ipc (Triton kernels writing into peers' buffers over GPU peer memory, one
node), mori (MoRI-EP, ROCm).
"""
from typing import Any, Protocol

import torch


class DispatchCombine(Protocol):
    graph_safe: bool  # no host sync: dispatch and combine can be captured in a CUDA graph

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


class NoDispatch:
    """All experts are local: nothing moves."""

    graph_safe = True

    def dispatch(self, x, topk_weights, topk_ids):
        return x, topk_weights, topk_ids, None

    def combine(self, y, handle):
        return y


BACKENDS = ("none", "local", "naive", "a2a", "ipc", "mori")


def make_dispatcher(backend: str, group=None, num_experts: int = 0, placement: str = "linear", *,
                    max_tokens_per_rank: int = 0, hidden_size: int = 0, dtype: torch.dtype | None = None,
                    uniform_tokens: bool = False, fp8: bool = False) -> DispatchCombine:
    """backend: one of BACKENDS. group: the expert-parallel process group (all ranks call this in
    the same order: ipc and mori construct collectively).

    max_tokens_per_rank, hidden_size, dtype: buffer sizes (ipc and mori need them).
    uniform_tokens: every rank passes the same T (naive then skips the counts exchange and is
    CUDA-graph capturable). fp8: send activations as float8_e4m3fn with a per-token scale (a2a).
    """
    if backend == "none":
        return NoDispatch()
    if backend not in BACKENDS:
        raise ValueError(f"unknown all2all backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "mori":
        from tandem.kernels.ep.mori import require_mori
        require_mori()
    if fp8 and backend != "a2a":
        raise ValueError(f"fp8 dispatch is implemented for the a2a backend only, not {backend!r}")
    if backend in ("ipc", "mori") and (max_tokens_per_rank <= 0 or hidden_size <= 0 or dtype is None):
        raise ValueError(f"the {backend} all2all backend preallocates its buffers: pass max_tokens_per_rank, "
                         f"hidden_size and dtype (got {max_tokens_per_rank}, {hidden_size}, {dtype})")
    if backend == "ipc" and not torch.cuda.is_available():
        raise ValueError("the ipc all2all backend moves tokens between GPUs of one node and found no GPU; "
                         "use naive or a2a")
    import torch.distributed as dist

    from tandem.kernels.ep.placement import ExpertMap
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = ExpertMap(num_experts, size, rank, placement)
    if backend == "local":
        from tandem.kernels.ep.local import LocalDispatch
        return LocalDispatch(experts)
    if backend == "naive":
        from tandem.kernels.ep.naive import NaiveDispatch
        return NaiveDispatch(group, experts, uniform_tokens=uniform_tokens)
    if backend == "a2a":
        from tandem.kernels.ep.a2a import AllToAllDispatch
        return AllToAllDispatch(group, experts, fp8=fp8)
    if backend == "mori":
        from tandem.kernels.ep.mori import MoriDispatch
        return MoriDispatch(group, experts, max_tokens_per_rank, hidden_size, dtype)
    from tandem.kernels.ep.ipc import IpcDispatch
    return IpcDispatch(group, experts, max_tokens_per_rank, hidden_size, dtype, uniform_tokens=uniform_tokens)

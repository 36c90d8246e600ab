"""Process-group state: tensor parallel (TP) and expert parallel (EP).

World of one unless torch.distributed is set up. EP spans the TP ranks (experts sharded
over ranks that hold the same tokens) or the data-parallel ranks (each with its own tokens,
moved by a dispatch/combine backend).
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_tp_group: dist.ProcessGroup | None = None


def init_tensor_parallel(group: dist.ProcessGroup | None) -> None:
    global _tp_group
    _tp_group = group


def tp_size() -> int:
    return dist.get_world_size(_tp_group) if _tp_group is not None else 1


def tp_rank() -> int:
    return dist.get_rank(_tp_group) if _tp_group is not None else 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


@dataclass
class ExpertParallel:
    """group: the EP ranks; backend: dispatch/combine (`local` when EP spans TP ranks);
    max_tokens_per_rank: the most tokens one rank passes to a MoE layer in one step;
    uniform_tokens: every rank passes the same number of tokens (DP ranks pad to the max)."""

    group: dist.ProcessGroup
    backend: str
    placement: str
    max_tokens_per_rank: int
    uniform_tokens: bool
    fp8: bool = False
    _dispatchers: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def graph_safe(self) -> bool:
        """Every dispatcher made so far can run inside a CUDA graph."""
        return all(d.graph_safe for d in self._dispatchers.values())

    def dispatcher(self, num_experts: int, hidden_size: int, dtype: torch.dtype):
        """One dispatcher per expert count and shape, shared by every MoE layer (its buffers are
        reused layer after layer). Every rank creates them in the same order (it may be collective)."""
        from tandem.kernels.ep import make_dispatcher

        key = (num_experts, hidden_size, dtype)
        if key not in self._dispatchers:
            self._dispatchers[key] = make_dispatcher(
                self.backend, self.group, num_experts, self.placement, max_tokens_per_rank=self.max_tokens_per_rank,
                hidden_size=hidden_size, dtype=dtype, uniform_tokens=self.uniform_tokens, fp8=self.fp8)
        return self._dispatchers[key]


_ep: ExpertParallel | None = None


def init_expert_parallel(ep: ExpertParallel | None) -> None:
    global _ep
    if _ep is not None:
        for d in _ep._dispatchers.values():
            getattr(d, "close", lambda: None)()
    _ep = ep


def expert_parallel() -> ExpertParallel | None:
    return _ep

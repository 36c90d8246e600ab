"""Tensor-parallel process group state (world of one unless torch.distributed is set up)."""
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

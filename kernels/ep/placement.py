"""Which EP rank holds which expert.

linear:      rank r holds experts [r * E/W, (r+1) * E/W)
round_robin: rank r holds experts r, r + W, r + 2W, ...
"""
import torch


def expert_owner_map(num_experts: int, ep_size: int, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (owner [E] rank of each global expert, local [E] its index among its rank's experts)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ep_size} expert-parallel ranks")
    e = torch.arange(num_experts)
    per_rank = num_experts // ep_size
    if strategy == "linear":
        return e // per_rank, e % per_rank
    if strategy == "round_robin":
        return e % ep_size, e // ep_size
    raise ValueError(f"unknown expert placement {strategy!r}; expected linear or round_robin")


def local_experts(num_experts: int, ep_size: int, rank: int, strategy: str) -> list[int]:
    """Global ids of the experts rank holds, in local-index order."""
    owner, local = expert_owner_map(num_experts, ep_size, strategy)
    mine = (owner == rank).nonzero().flatten()
    return mine[local[mine].argsort()].tolist()

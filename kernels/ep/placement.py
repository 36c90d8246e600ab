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


def local_index_map(owner: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """[E] int32: each global expert's local index on `rank`, -1 where another rank holds it."""
    return torch.where(owner == rank, local, -1).to(torch.int32)


def local_experts(num_experts: int, ep_size: int, rank: int, strategy: str) -> list[int]:
    """Global ids of the experts rank holds, in local-index order."""
    owner, local = expert_owner_map(num_experts, ep_size, strategy)
    mine = (owner == rank).nonzero().flatten()
    return mine[local[mine].argsort()].tolist()


class ExpertMap:
    """The placement seen from one rank, as int32 tensors kept on each device they are used on
    (copied once: a host-to-device copy cannot be captured in a CUDA graph, so the first call,
    eager, makes the copy and graph captures reuse it).

    owner [E]: rank of each global expert; local [E]: its index on that rank;
    mine [E]: its index on this rank, -1 where another rank holds it.
    """

    def __init__(self, num_experts: int, ep_size: int, rank: int, strategy: str):
        owner, local = expert_owner_map(num_experts, ep_size, strategy)
        self.num_experts, self.size, self.rank, self.strategy = num_experts, ep_size, rank, strategy
        self._cpu = {"owner": owner.int(), "local": local.int(), "mine": local_index_map(owner, local, rank)}
        self._dev: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, torch.device(device))
        t = self._dev.get(key)
        if t is None:
            t = self._dev[key] = self._cpu[name].to(device)
        return t

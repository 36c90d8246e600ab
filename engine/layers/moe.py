"""Mixture-of-experts block: router (top-k) -> dispatch -> experts -> combine.

Experts are stacked in two parameters, w13 [E, 2I, H] ([gate | up] rows) and
w2 [E, H, I]; the dispatch/combine backend and the experts kernel are chosen
from the ParallelConfig, so models never name them.
"""
import torch
from torch import nn

from engine.config import ParallelConfig
from engine.layers.linear import ReplicatedLinear
from engine.parallel import tp_all_reduce, tp_rank, tp_size
from kernels.ep import make_dispatcher
from kernels.moe import fused_experts, fused_experts_ref, topk_routing

_EXPERTS_IMPLS = {"auto": fused_experts, "triton": fused_experts, "torch": fused_experts_ref}


def experts_impl(name: str):
    if name == "aiter":
        raise ValueError("--moe-experts aiter needs ROCm with the aiter package; use triton or torch")
    if name not in _EXPERTS_IMPLS:
        raise ValueError(f"unknown --moe-experts {name!r}; expected one of {sorted(_EXPERTS_IMPLS)}")
    return _EXPERTS_IMPLS[name]


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, parallel: ParallelConfig, scoring: str = "softmax"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scoring = renormalize, scoring
        if intermediate_size % tp_size():
            raise ValueError(f"MoE intermediate size {intermediate_size} is not divisible by the TP size {tp_size()}")
        # Tensor parallel: every rank holds every expert's slice of the intermediate dimension.
        self.intermediate_size = intermediate_size // tp_size()
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        if parallel.enable_expert_parallel or parallel.all2all_backend != "none":
            raise ValueError("expert parallelism (--enable-expert-parallel, --all2all-backend other than none) "
                             "is not wired into the engine yet; the backends live in kernels/ep")
        self.dispatcher = make_dispatcher("none")
        self.experts = experts_impl(parallel.moe_experts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: None (all experts stacked) or (expert, part) with part 0 = gate, 1 = up,
        None = down."""
        size, rank = self.intermediate_size, tp_rank()
        if shard_id is None:
            dst = param.data
            if param is self.w13:  # [E, 2I, H]: this rank's rows of gate and of up
                full = loaded.shape[1] // 2
                loaded = torch.cat([loaded[:, rank * size:(rank + 1) * size],
                                    loaded[:, full + rank * size:full + (rank + 1) * size]], dim=1)
            else:
                loaded = loaded.narrow(2, rank * size, size)
        else:
            expert, part = shard_id
            dst = param.data[expert]
            if part is not None:
                dst = dst.narrow(0, part * size, size)
                loaded = loaded.narrow(0, rank * size, size)
            else:
                loaded = loaded.narrow(1, rank * size, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"experts: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        weights, ids = topk_routing(self.gate(x), self.top_k, self.renormalize, self.scoring)
        x, weights, ids, handle = self.dispatcher.dispatch(x, weights, ids)
        y = self.experts(x, self.w13, self.w2, weights, ids)
        return tp_all_reduce(self.dispatcher.combine(y, handle))

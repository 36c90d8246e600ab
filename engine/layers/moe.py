"""Mixture-of-experts block: router (top-k) -> dispatch -> experts -> combine.

Experts are stacked in two parameters, w13 [E, 2I, H] ([gate | up] rows) and
w2 [E, H, I]; the dispatch/combine backend and the experts kernel are chosen
from the ParallelConfig, so models never name them.
"""
import torch
from torch import nn

from tandem.engine.config import ParallelConfig
from tandem.engine.layers.linear import ReplicatedLinear
from tandem.engine.layers.norm import DeferredOutput, RMSNorm, next_quant
from tandem.engine.parallel import expert_parallel, tp_all_reduce, tp_rank, tp_size
from tandem.kernels import KernelConfig
from tandem.kernels.ep import NoDispatch, make_dispatcher
from tandem.kernels.ep.placement import local_experts
from tandem.kernels.linear import PendingNorm, can_pend
from tandem.kernels.moe import fused_experts, fused_experts_ref, routed_experts, topk_routing

_EXPERTS_IMPLS = {"triton": fused_experts, "torch": fused_experts_ref}


def experts_impl(name: str):
    """The experts kernel for --moe-experts; auto = aiter on ROCm when it imports, else triton
    (which falls back to the torch reference on CPU)."""
    from tandem.kernels.moe_aiter import aiter_available, fused_experts_aiter, require_aiter

    if name == "auto":
        name = "aiter" if aiter_available() else "triton"
    if name == "aiter":
        require_aiter()
        return fused_experts_aiter
    if name not in _EXPERTS_IMPLS:
        raise ValueError(f"unknown --moe-experts {name!r}; expected auto, aiter, {', '.join(_EXPERTS_IMPLS)}")
    return _EXPERTS_IMPLS[name]


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, parallel: ParallelConfig, scoring: str = "softmax", *, kernels: KernelConfig):
        super().__init__()
        self.kernels = kernels
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scoring = renormalize, scoring
        ep = expert_parallel() if parallel.enable_expert_parallel else None
        if ep is not None and ep.size > 1:
            # Expert parallel: this rank holds whole experts (global ids self.expert_ids, in local
            # order); the dispatcher maps global ids to ranks and local indices.
            self.expert_ids = local_experts(num_experts, ep.size, ep.rank, ep.placement)
            self.shards, self.shard = 1, 0
            self.dispatcher = ep.dispatcher(num_experts, hidden_size, torch.get_default_dtype())
        else:
            # Tensor parallel: every rank holds every expert's slice of the intermediate dimension.
            self.expert_ids = list(range(num_experts))
            self.shards, self.shard = tp_size(), tp_rank()
            self.dispatcher = make_dispatcher("none")
        if intermediate_size % self.shards:
            raise ValueError(f"MoE intermediate size {intermediate_size} is not divisible by the TP size {self.shards}")
        self.intermediate_size = intermediate_size // self.shards
        self._local_index = {e: i for i, e in enumerate(self.expert_ids)}
        n = len(self.expert_ids)
        self.gate = ReplicatedLinear(hidden_size, num_experts, kernels=kernels)
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, self.intermediate_size), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.experts = experts_impl(parallel.moe_experts)

    def process_weights_after_loading(self) -> None:
        from tandem.kernels.moe_aiter import fused_experts_aiter, shuffle_expert_weights

        if self.experts is fused_experts_aiter:
            w13, w2 = shuffle_expert_weights(self.w13.data, self.w2.data)
            self.w13.data, self.w2.data = w13, w2

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: None (all experts stacked) or (expert, part) with part 0 = gate, 1 = up,
        None = down. Experts held by other EP ranks are skipped."""
        size, rank = self.intermediate_size, self.shard
        if shard_id is None:
            dst = param.data
            if len(self.expert_ids) != self.num_experts:
                loaded = loaded[self.expert_ids]
            if param is self.w13:  # [E, 2I, H]: this rank's rows of gate and of up
                full = loaded.shape[1] // 2
                loaded = torch.cat([loaded[:, rank * size:(rank + 1) * size],
                                    loaded[:, full + rank * size:full + (rank + 1) * size]], dim=1)
            else:
                loaded = loaded.narrow(2, rank * size, size)
        else:
            expert, part = shard_id
            if expert not in self._local_index:
                return
            dst = param.data[self._local_index[expert]]
            if part is not None:
                dst = dst.narrow(0, part * size, size)
                loaded = loaded.narrow(0, rank * size, size)
            else:
                loaded = loaded.narrow(1, rank * size, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"experts: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | DeferredOutput:
        """x: [T, H] normalized rows, or a PendingNorm (its norm applied by the router GEMM and the
        first expert GEMM) -> [T, H]. With every expert here (the routed Triton experts), the
        output is a DeferredOutput: the RMSNorm after it may have the experts add the residual
        and leave that norm pending (on a GPU at decode sizes; engine/layers/norm.py)."""
        pending = isinstance(x, PendingNorm)
        gate = self._gate_in_experts(x)
        logits = self.gate(x) if gate is None else None
        if not self._routed_here(x):
            h = x.normed(self.kernels) if pending else x
            weights, ids = topk_routing(logits, self.top_k, self.renormalize, self.scoring, self.kernels)
            h, weights, ids, handle = self.dispatcher.dispatch(h, weights, ids)
            y = self.experts(h, self.w13, self.w2, weights, ids, **self._experts_args)
            return tp_all_reduce(self.dispatcher.combine(y, handle))
        # all experts here: routing and experts in one call (on a GPU at decode sizes the first
        # expert GEMM ranks the experts itself)
        return DeferredOutput(lambda: tp_all_reduce(self._routed(x, logits, gate=gate)),
                              lambda residual, norm: self._routed_add_norm(x, logits, residual, norm, gate))

    def _routed_here(self, x: torch.Tensor | PendingNorm) -> bool:
        """Whether routing and experts run as one routed_experts call (every expert here, the
        Triton experts)."""
        return self.experts is fused_experts and isinstance(self.dispatcher, NoDispatch)

    def _gate_in_experts(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | None:
        """The router weight where the routed experts run the router GEMM themselves (FP8 experts on the ring:
        kernels.fp8.ring_router), else None."""
        return None

    @property
    def _expert_scales(self) -> tuple | None:
        return None

    @property
    def _experts_args(self) -> dict:
        return dict(config=self.kernels) if self.experts is fused_experts else {}

    def _routed(self, x: torch.Tensor | PendingNorm, logits: torch.Tensor | None, norm_out: tuple | None = None,
                gate: torch.Tensor | None = None, quant: tuple | None = None):
        pending = isinstance(x, PendingNorm)
        ahead = (x.router, x.quant) if pending and x.router is not None and gate is not None else None
        return routed_experts(x.sg if pending else x, logits, self.w13, self.w2, self.top_k, self.renormalize,
                              self.scoring, (x.ss, x.eps) if pending else None, norm_out, self.kernels,
                              self._expert_scales, gate, quant, ahead)

    def _routed_add_norm(self, x: torch.Tensor | PendingNorm, logits: torch.Tensor | None, residual: torch.Tensor,
                         norm: RMSNorm, gate: torch.Tensor | None = None) -> PendingNorm | None:
        """The experts' output plus the residual with `norm` left pending, or None (nothing run)
        where that does not apply (tensor parallel: the all-reduce comes first; no GPU; more rows)."""
        if not (tp_size() == 1 and can_pend(x.sg if isinstance(x, PendingNorm) else x, self.kernels)):
            return None
        s, sg, ss, *quant = self._routed(x, logits, (residual, norm.weight), gate, next_quant(norm, residual))
        return PendingNorm(s, sg, ss, norm.weight, norm.eps, quant[0] if quant else None)

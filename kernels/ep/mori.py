"""mori dispatch/combine: MoRI-EP's intra-node kernels (`mori.ops.EpDispatchCombineOp`, ROCm).

Written against MoRI's published Python API (EpDispatchCombineConfig / EpDispatchCombineOp:
dispatch(x, weights, scales, ids) -> (x', weights', scales', global ids', received count);
combine(y, weights, ids) -> (out [max_tokens, H], weights); reset() between rounds).
Untested: this repository's machines have no ROCm GPU. MoRI places experts linearly (rank r
holds experts [r * E/W, (r+1) * E/W)) and needs top-k at construction, so its op is built at the
first dispatch (a collective: every rank dispatches in the same order).
"""
import torch
import torch.distributed as dist

from tandem.kernels.backend import require_rocm_package, rocm_package_available
from tandem.kernels.ep.placement import ExpertMap

_SHMEM_GROUP = "tandem_ep"


def mori_available() -> bool:
    return rocm_package_available("mori")


def require_mori() -> None:
    """Raise a clear error unless MoRI-EP (github.com/ROCm/mori) can run here."""
    require_rocm_package("mori", "the mori all2all backend", "naive, a2a or ipc")


class MoriDispatch:
    graph_safe = False  # not known to be capturable (untested here)

    def __init__(self, group: dist.ProcessGroup, experts: ExpertMap, max_tokens_per_rank: int,
                 hidden_size: int, dtype: torch.dtype):
        import mori

        if experts.strategy != "linear":
            raise ValueError(f"the mori all2all backend places experts linearly; got placement {experts.strategy!r}")
        self.group, self.experts = group, experts
        self.max_tokens, self.hidden, self.dtype = max_tokens_per_rank, hidden_size, dtype
        torch._C._distributed_c10d._register_process_group(_SHMEM_GROUP, group)
        mori.shmem.shmem_torch_process_group_init(_SHMEM_GROUP)
        self.op = None

    def _build(self, top_k: int) -> None:
        import mori

        config = mori.ops.EpDispatchCombineConfig(
            data_type=self.dtype, rank=self.experts.rank, world_size=self.experts.size, hidden_dim=self.hidden,
            scale_dim=0, scale_type_size=4, max_token_type_size=4, max_num_inp_token_per_rank=self.max_tokens,
            num_experts_per_rank=self.experts.num_experts // self.experts.size, num_experts_per_token=top_k,
            kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNode)
        self.op = mori.ops.EpDispatchCombineOp(config)

    def dispatch(self, x, topk_weights, topk_ids):
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"mori dispatch got {x.shape[0]} tokens, more than max_tokens_per_rank={self.max_tokens}")
        if self.op is None:
            self._build(topk_ids.shape[1])
        topk_ids = topk_ids.to(torch.int32).contiguous()
        out, weights, _, global_ids, num_received = self.op.dispatch(x, topk_weights.float(), None, topk_ids)
        # Rows past the received count are stale: their ids become -1 like other ranks' experts.
        rows = torch.arange(out.shape[0], device=out.device)
        mine = self.experts.get("mine", out.device)[global_ids.long().clamp(0, self.experts.num_experts - 1)]
        local_ids = torch.where((rows < num_received.to(rows.dtype))[:, None], mine, -1)
        return out, weights, local_ids, (topk_ids, x.shape[0])

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        topk_ids, num_tokens = handle
        out = self.op.combine(y, None, topk_ids)[0][:num_tokens].clone()
        self.op.reset()
        return out

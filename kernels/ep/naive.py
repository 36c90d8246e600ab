"""naive dispatch/combine: every rank sees every token (all-gather), computes its own
experts' share, and the shares are summed back onto the tokens' home ranks
(reduce-scatter). Simple and exact; moves W times more data than needed.

Ranks may pass different token counts: the counts are all-gathered first (on x.device, one
host sync) and every rank pads to the largest. With uniform_tokens the caller guarantees equal
counts: no counts exchange, no host sync, and the whole path can be captured in a CUDA graph.
"""
import torch
import torch.distributed as dist

from tandem.kernels.ep.placement import ExpertMap


class NaiveDispatch:
    def __init__(self, group: dist.ProcessGroup, experts: ExpertMap, uniform_tokens: bool = False):
        self.group, self.size = group, dist.get_world_size(group)
        self.experts, self.uniform = experts, uniform_tokens
        self.graph_safe = uniform_tokens  # otherwise the counts exchange syncs with the host

    def _gather(self, t: torch.Tensor, max_tokens: int) -> torch.Tensor:
        if t.shape[0] == max_tokens:
            padded = t.contiguous()
        else:
            padded = t.new_zeros((max_tokens, *t.shape[1:]))
            padded[:t.shape[0]] = t
        out = t.new_empty((self.size * max_tokens, *t.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=self.group)
        return out

    def dispatch(self, x, topk_weights, topk_ids):
        num_tokens, dev = x.shape[0], x.device
        counts = None
        if self.uniform:
            max_tokens = num_tokens
        else:
            counts = torch.empty(self.size, dtype=torch.int64, device=dev)
            dist.all_gather_into_tensor(counts, torch.full((1,), num_tokens, dtype=torch.int64, device=dev),
                                        group=self.group)
            max_tokens = int(counts.max())
        handle = (num_tokens, max_tokens)
        if max_tokens == 0:  # every rank is idle: nothing to gather
            return x, topk_weights, topk_ids, handle
        ids = self._gather(topk_ids, max_tokens)
        local_ids = self.experts.get("mine", dev)[ids.long()]
        if counts is not None:
            # Pad rows carry id -1: they add nothing anywhere.
            row = torch.arange(ids.shape[0], device=dev)
            real = (row % max_tokens) < counts[row // max_tokens]
            local_ids = torch.where(real[:, None], local_ids, -1)
        return self._gather(x, max_tokens), self._gather(topk_weights, max_tokens), local_ids, handle

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        num_tokens, max_tokens = handle
        if max_tokens == 0:
            return y
        out = y.new_empty((max_tokens, *y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), group=self.group)
        return out[:num_tokens]

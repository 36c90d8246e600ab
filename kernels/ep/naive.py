"""naive dispatch/combine: every rank sees every token (all-gather), computes its own
experts' share, and the shares are summed back onto the tokens' home ranks
(reduce-scatter). Simple and exact; moves W times more data than needed."""
import torch
import torch.distributed as dist


class NaiveDispatch:
    def __init__(self, group: dist.ProcessGroup, owner: torch.Tensor, local: torch.Tensor):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.owner, self.local = owner, local  # [E] global expert -> rank, local index

    def _gather(self, t: torch.Tensor, max_tokens: int) -> torch.Tensor:
        padded = t.new_zeros((max_tokens, *t.shape[1:]))
        padded[:t.shape[0]] = t
        out = t.new_empty((self.size * max_tokens, *t.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=self.group)
        return out

    def dispatch(self, x, topk_weights, topk_ids):
        counts = torch.tensor([x.shape[0]], dtype=torch.long)
        all_counts = [torch.zeros_like(counts) for _ in range(self.size)]
        dist.all_gather(all_counts, counts, group=self.group)
        max_tokens = max(int(c) for c in all_counts)
        ids = self._gather(topk_ids.long(), max_tokens)
        owner, local = self.owner.to(ids.device)[ids], self.local.to(ids.device)[ids]
        # Pad rows carry weight 0 and id -1: they add nothing anywhere.
        row = torch.arange(ids.shape[0], device=ids.device)
        real = (row % max_tokens) < torch.cat(all_counts).to(ids.device)[row // max_tokens]
        local_ids = torch.where((owner == self.rank) & real[:, None], local, torch.full_like(local, -1))
        handle = (x.shape[0], max_tokens)
        return self._gather(x, max_tokens), self._gather(topk_weights, max_tokens), local_ids.int(), handle

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        num_tokens, max_tokens = handle
        out = y.new_empty((max_tokens, *y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), group=self.group)
        return out[:num_tokens]

"""a2a dispatch/combine: each (token, expert) pair goes only to the rank holding that expert,
with exact per-rank splits (`all_to_all_single`), and comes back the same way to be summed
onto its token."""
import torch
import torch.distributed as dist


class AllToAllDispatch:
    def __init__(self, group: dist.ProcessGroup, owner: torch.Tensor, local: torch.Tensor):
        self.group, self.size = group, dist.get_world_size(group)
        self.owner, self.local = owner, local

    def _exchange(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, send, group=self.group)
        return out

    def dispatch(self, x, topk_weights, topk_ids):
        num_tokens, k = topk_ids.shape
        ids = topk_ids.long().flatten()
        dest = self.owner.to(ids.device)[ids]
        order = torch.argsort(dest, stable=True)
        token_of_pair = (torch.arange(num_tokens * k, device=ids.device) // k)[order]
        send_counts = torch.bincount(dest, minlength=self.size).cpu()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = self._exchange(x[token_of_pair], send, recv)
        weights = self._exchange(topk_weights.flatten()[order], send, recv)
        local_ids = self._exchange(self.local.to(ids.device)[ids][order], send, recv)
        # One (token, expert) pair per received row: top-1 with its own weight.
        return rows, weights[:, None], local_ids[:, None].int(), (token_of_pair, send, recv, num_tokens)

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        token_of_pair, send, recv, num_tokens = handle
        back = self._exchange(y, recv, send)
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token_of_pair, back.float())
        return out.to(y.dtype)

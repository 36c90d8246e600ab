"""a2a dispatch/combine: each (token, expert) pair goes only to the rank holding that expert,
with exact per-rank splits (`all_to_all_single`), and comes back the same way to be summed
onto its token.

The split sizes are exchanged on x.device and read on the host (one sync per dispatch), so
this path cannot be captured in a CUDA graph. With fp8 the rows travel as float8_e4m3fn with a
per-token float32 scale (kernels/ep/fp8.py) and are dequantized on arrival; the experts and
the combine stay in x.dtype.
"""
import torch
import torch.distributed as dist

from tandem.kernels.ep.fp8 import dequantize_rows, quantize_rows
from tandem.kernels.ep.placement import ExpertMap


class AllToAllDispatch:
    graph_safe = False  # split sizes are read on the host

    def __init__(self, group: dist.ProcessGroup, experts: ExpertMap, fp8: bool = False):
        self.group, self.size = group, dist.get_world_size(group)
        self.experts, self.fp8 = experts, fp8

    def _exchange(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, send, group=self.group)
        return out

    def dispatch(self, x, topk_weights, topk_ids):
        num_tokens, k = topk_ids.shape
        dev = x.device
        ids = topk_ids.long().flatten()
        dest = self.experts.get("owner", dev)[ids]
        order = torch.argsort(dest, stable=True)
        token_of_pair = (torch.arange(num_tokens * k, device=dev) // k)[order]
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = torch.stack([send_counts, recv_counts]).tolist()
        if self.fp8:  # quantize each token once, then send its packed row once per pair
            rows = dequantize_rows(self._exchange(quantize_rows(x)[token_of_pair], send, recv), x.dtype)
        else:
            rows = self._exchange(x[token_of_pair], send, recv)
        # weight (float32 bits) and local expert id travel together as one int32 pair per row
        local_ids = self.experts.get("local", dev)[ids][order]
        meta = torch.stack([topk_weights.float().flatten()[order].view(torch.int32), local_ids], dim=1)
        meta = self._exchange(meta, send, recv)
        # One (token, expert) pair per received row: top-1 with its own weight.
        weights = meta[:, 0].contiguous().view(torch.float32)[:, None]
        return rows, weights, meta[:, 1:].contiguous(), (token_of_pair, send, recv, num_tokens)

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        token_of_pair, send, recv, num_tokens = handle
        back = self._exchange(y, recv, send)
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token_of_pair, back.float())
        return out.to(y.dtype)

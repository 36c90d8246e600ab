"""CUDA graphs for decode steps: one captured forward pass per batch size; a decode batch is
padded to the next captured size and replayed, which removes the per-kernel launch cost
that dominates small-batch decode.

Static inputs live in buffers sized for the largest graph; padding rows store nothing
(slot -1) and attend to one slot of block 0, and their outputs are dropped.
"""
import logging

import torch

from engine.forward_context import ForwardContext

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _ctx(self, n: int) -> ForwardContext:
        return ForwardContext(slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
                              seq_lens=self.seq_lens[:n], query_start_loc=self.query_start_loc[:n + 1],
                              max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            args = (self.input_ids[:n], self.positions[:n], self._ctx(n))
            self.model(*args)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """CPU tensors for n decode tokens (one per sequence) -> hidden states [n, hidden]."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        graph, out = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.block_tables[n:size].zero_()
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        graph.replay()
        return out[:n]

"""CUDA graphs for decode steps: one captured forward pass per batch size; a decode batch is
padded to the next captured size and replayed, which removes the per-kernel launch cost
that dominates small-batch decode.

Each graph runs the decoder and the LM head, so a pure decode step gets its logits (float32,
every row) from the replay with no eager launch. Static inputs live in buffers sized for the
largest graph, filled by three host-to-device copies; padding rows store nothing (slot -1)
and attend to one slot of block 0, and their outputs are dropped.
"""
import logging

import torch

from tandem.engine.forward_context import ForwardContext

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, with_logits: bool = True):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.with_logits = with_logits
        n = self.sizes[-1]
        # rows: input ids, positions, slot mapping (one copy fills all three)
        self.tokens = torch.zeros(3, n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.tokens
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        # a capture stream of this device: torch's default one is made once per process, on the device
        # current then, and capturing on it moves launches to that device (two engines, two GPUs)
        self.capture_stream = torch.cuda.Stream(device)
        self._capture()

    def _ctx(self, n: int) -> ForwardContext:
        return ForwardContext(slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
                              seq_lens=self.seq_lens[:n], query_start_loc=self.query_start_loc[:n + 1],
                              max_query_len=1, max_seq_len=self.max_model_len)

    def _forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self._ctx(n))
        return hidden, self.model.compute_logits(hidden).float() if self.with_logits else None

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(n)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.capture_stream):
                hidden, logits = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = (graph, hidden, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s%s", self.sizes,
                    " (decoder and LM head)" if self.with_logits else "")

    def release(self) -> None:
        """Free the graphs now rather than whenever the last reference goes: a graph that
        captured NCCL work must be gone before its communicator is torn down."""
        torch.cuda.synchronize()
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CPU tensors for n decode tokens (one per sequence) -> (hidden states [n, hidden],
        logits [n, vocab] float32, or None when captured without the LM head). Both are the
        graph's own buffers: valid until the next replay. input_ids may be on the device
        (the previous step's sampled tokens, --async-scheduling)."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        graph, hidden, logits = self.graphs[size]
        pad = size - n
        ids_on_device = input_ids.device != positions.device
        host_ids = torch.zeros_like(positions) if ids_on_device else input_ids
        tokens = torch.stack([host_ids, positions, slot_mapping.to(torch.long)])
        seq_lens = seq_lens.to(torch.int32)
        block_tables = block_tables.to(torch.int32)
        if pad:
            tokens = torch.cat([tokens, torch.tensor([[0], [0], [-1]]).expand(3, pad)], dim=1)
            seq_lens = torch.cat([seq_lens, torch.ones(pad, dtype=torch.int32)])
            block_tables = torch.cat([block_tables, block_tables.new_zeros(pad, block_tables.shape[1])])
        self.tokens[:, :size].copy_(tokens, non_blocking=True)
        self.seq_lens[:size].copy_(seq_lens, non_blocking=True)
        self.block_tables[:size, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if ids_on_device:
            self.input_ids[:n].copy_(input_ids)
        graph.replay()
        return hidden[:n], None if logits is None else logits[:n]

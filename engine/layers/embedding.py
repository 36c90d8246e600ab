"""Vocabulary-parallel embedding and LM head (each rank holds a slice of the vocabulary)."""
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.parallel import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from tandem.kernels import KernelConfig
from tandem.kernels.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] < self.vocab_size:
            raise ValueError(f"embedding: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected ({self.vocab_size}, {param.shape[1]})")
        part = loaded[self.start:self.start + self.shard_size]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask[:, None]
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary: [T, hidden] -> [T, vocab_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, kernels: KernelConfig):
        super().__init__(vocab_size, hidden_size)
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, config=self.kernels)
        return tp_all_gather(logits, dim=-1)[:, :self.vocab_size]

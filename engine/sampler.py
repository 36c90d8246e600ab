"""Turns the last-position logits of a batch into next tokens, one row per request.

Order, as in vLLM: the structured-output grammar mask first; logprobs are taken from
those logits; then penalties, logit_bias, the min_tokens mask, temperature, top-k,
top-p, min-p; then sampling. Sampling is
argmax(probs / q) with q ~ Exp(1) drawn from the request's own generator when it
has a seed, so a seeded request samples the same tokens alone or in any batch.
"""
from dataclasses import dataclass

import torch

from tandem.engine.protocol import TokenLogprobs
from tandem.engine.request import Request
from tandem.engine.structured_output import apply_grammar_bitmask
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig
from tandem.kernels.sampling import argmax


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per step by the model runner."""

    requests: list[Request]
    # [N] each; None when every row is greedy (nothing reads them then: no copies to the GPU)
    temperature: torch.Tensor | None  # float32, 0 = greedy
    top_k: torch.Tensor | None  # int64, vocab size = disabled
    top_p: torch.Tensor | None  # float32
    min_p: torch.Tensor | None  # float32
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_min_tokens: bool
    max_logprobs: int  # largest top-N asked for in this batch; -1 = none asked
    any_grammar: bool = False  # some row's output is constrained (request.grammar)
    # logit_bias of every row as (rows [K] int64, token ids [K] int64, biases [K] float32); None: none
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device) -> "SamplingBatch":
        ps = [r.params for r in requests]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        all_greedy = all(p.greedy for p in ps)
        floats = top_k_t = None
        if not all_greedy:
            # Built on the host and sent with non-blocking copies: torch.tensor(..., device=cuda)
            # would wait for the GPU to finish the forward pass queued before it.
            floats = torch.tensor([[0.0 if p.greedy else p.temperature for p in ps], [p.top_p for p in ps],
                                   [p.min_p for p in ps]]).to(device, non_blocking=True)
            top_k_t = torch.tensor(top_k).to(device, non_blocking=True)
        return cls(
            requests=requests,
            temperature=None if floats is None else floats[0],
            top_k=top_k_t,
            top_p=None if floats is None else floats[1],
            min_p=None if floats is None else floats[2],
            all_greedy=all_greedy,
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1 for p in ps),
            any_min_p=any(p.min_p > 0 for p in ps),
            any_penalty=any(p.needs_penalties for p in ps),
            any_min_tokens=any(r.num_output_tokens < r.params.min_tokens for r in requests),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
            any_grammar=any(r.grammar is not None for r in requests),
            logit_bias=_logit_bias(ps, vocab_size, device),
        )


def _logit_bias(ps: list, vocab_size: int, device: torch.device):
    rows, ids, vals = [], [], []
    for i, p in enumerate(ps):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(i)
                ids.append(token_id)
                vals.append(bias)
    if not rows:
        return None
    return (torch.tensor(rows).to(device, non_blocking=True), torch.tensor(ids).to(device, non_blocking=True),
            torch.tensor(vals, dtype=torch.float32).to(device, non_blocking=True))


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> list[TokenLogprobs]:
    """logprobs: [N, V] log-softmax; token_ids: [N] actual tokens -> one TokenLogprobs per row."""
    chosen = logprobs.gather(1, token_ids[:, None].long())
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_ids = logprobs.topk(top_n, dim=1) if top_n > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    ids = torch.cat([token_ids[:, None].long(), top_ids.long()], dim=1).tolist()
    vals = torch.cat([chosen, top_vals], dim=1).tolist()
    return [TokenLogprobs(token_ids=i, logprobs=v, rank=r) for i, v, r in zip(ids, vals, ranks.tolist())]


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    n, vocab = logits.shape
    device = logits.device
    for i, req in enumerate(requests):
        p = req.params
        if not p.needs_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), device=device, dtype=torch.long)
            seen = seen[seen < vocab]
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        out = req.output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, device=device), minlength=vocab)[:vocab].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def _mask_stop_tokens(logits: torch.Tensor, requests: list[Request], eos_token_ids: set[int]) -> None:
    vocab = logits.shape[1]
    for i, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens:
            banned = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else eos_token_ids)
            ids = [t for t in banned if t < vocab]
            if ids:
                logits[i, ids] = float("-inf")


def _top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.any_top_k or b.any_top_p:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        mask = ranks >= b.top_k[:, None]
        if b.any_top_p:
            probs = sorted_logits.softmax(dim=-1)
            # Keep a token if the mass before it is below top_p (the top token always stays).
            mask |= (probs.cumsum(dim=-1) - probs) >= b.top_p[:, None]
        sorted_logits.masked_fill_(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if b.any_min_p:
        probs = logits.softmax(dim=-1)
        keep = probs >= b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch, eos_token_ids: set[int],
           kernels: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
    """logits: [N, V] float32 -> (token ids [N] int64, per-row logprobs (None for rows that did
    not ask) or None when no row asked)."""
    if b.any_grammar:  # (a copy: logits may be a CUDA graph's output buffer)
        logits = logits.clone()
        apply_grammar_bitmask(logits, [r.grammar for r in b.requests])
    raw_logprobs = logits.log_softmax(dim=-1) if b.max_logprobs >= 0 else None
    if b.any_penalty:
        logits = _apply_penalties(logits.clone(), b.requests)
    if b.logit_bias is not None:
        logits = logits.index_put(b.logit_bias[:2], b.logit_bias[2], accumulate=True)
    if b.any_min_tokens:
        logits = logits.clone()
        _mask_stop_tokens(logits, b.requests, eos_token_ids)
    greedy_tokens = argmax(logits, kernels)
    if b.all_greedy:
        tokens = greedy_tokens
    else:
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        scaled = _top_k_top_p_min_p(logits / temp[:, None], b)
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for i, req in enumerate(b.requests):
            if req.generator is not None:
                for _ in range(req.skipped_draws):  # PD decode: advance past the prefill's draw
                    q[i].exponential_(generator=req.generator)
                req.skipped_draws = 0
                q[i].exponential_(generator=req.generator)
        tokens = torch.where(b.temperature > 0, argmax(probs.div(q), kernels), greedy_tokens)
    logprobs = None
    if raw_logprobs is not None:
        logprobs = token_logprobs(raw_logprobs, tokens, b.max_logprobs)
        for i, req in enumerate(b.requests):
            n = req.params.logprobs
            if n is None:
                logprobs[i] = None
            else:
                del logprobs[i].token_ids[n + 1:], logprobs[i].logprobs[n + 1:]
    return tokens, logprobs

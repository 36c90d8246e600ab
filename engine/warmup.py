"""Compile-ahead: run, before the server reports ready, one eager forward pass (and the sampling
argmax) for every kernel variant an eager step of the scheduler can need, so no request waits
for a Triton compile while serving. Decode-only steps replay CUDA graphs, captured at start-up.

What makes Triton build a new variant of a kernel: a different value of a constexpr (tile plans
chosen from token counts: attention's narrow/wide/split launches, the MoE tile config by pairs,
the skinny GEMM under 16 rows, the FP8 GEMM's row buckets), and for plain int arguments the class
of the value (== 1, divisible by 16, other) unless the argument is marked do_not_specialize. So a step's variant
is a function of its token count, sequence count, longest query and context, and whether every
prefill starts at position 0 (attention then reads the new keys densely). `eager_signature`
maps a batch to that key, calling the kernels' own plan function for attention; the warm-up
enumerates a grid of batches the scheduler can form within its limits and runs one batch per
distinct key. kernels/compile_watch.py counts what still compiles after ready.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupBatch:
    """One eager step: per sequence, its new tokens (query_lens) and context incl. them (seq_lens)."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def from_start(self) -> bool:
        """Every sequence of more than one new token starts at position 0 (the model runner's flag)."""
        return all(q == 1 or q == s for q, s in zip(self.query_lens, self.seq_lens))


def int_class(n: int) -> str:
    """How Triton specializes a plain int argument by value."""
    return "one" if n == 1 else "d16" if n % 16 == 0 else "any"


def interesting_counts(limit: int) -> list[int]:
    """1..17, then each power of two p with p - 1 and p + 1, 3p/2, and the limit: every class of
    int_class and every power-of-two threshold of the tile plans, up to limit."""
    values = set(range(1, 18))
    p = 16
    while p <= 2 * limit:
        values |= {p - 1, p, p + 1, p + p // 2}
        p *= 2
    values.add(limit)
    return sorted(v for v in values if 1 <= v <= limit)


def candidate_batches(max_tokens: int, max_seqs: int, max_model_len: int,
                      block_size: int = 16) -> Iterator[WarmupBatch]:
    """Steps the scheduler can form: S - 1 decodes and one prompt chunk of T - S + 1 tokens, the
    chunk either a prefill from position 0 or a later chunk behind a context; contexts at powers
    of two up to max_model_len, one token short of each and one block past (block tables of every
    width class with every split count).
    Decode-only batches appear when S = T."""
    powers = [1 << k for k in range(4, max_model_len.bit_length() + 1)]
    contexts = sorted({min(max_model_len, c) for p in powers for c in (p - 1, p, p + block_size)} | {max_model_len})
    for t in interesting_counts(max_tokens):
        for s in interesting_counts(min(max_seqs, t)):
            chunk = t - s + 1
            if chunk > max_model_len:
                continue
            for ctx in contexts:
                if ctx < chunk:
                    continue
                decodes = (1,) * (s - 1)
                # the chunk from position 0 (ctx == chunk) or behind ctx - chunk tokens of context
                yield WarmupBatch(decodes + (chunk,), (ctx,) * (s - 1) + (chunk,))
                if ctx > chunk:
                    yield WarmupBatch(decodes + (chunk,), (ctx,) * s)


PlanFn = Callable[[WarmupBatch], object]  # a kernel's plan choice for a batch (hashable)


def eager_signature(batch: WarmupBatch, plan_fns: tuple[PlanFn, ...] = ()) -> tuple:
    """The kernel-variant key of a batch (see the module docstring): the int classes of the token
    and sequence counts (sampled rows), whether the skinny GEMM path applies (<= 16 rows), dense
    prefill keys, and each kernel plan function's choice; without plan functions, the powers of
    two of the longest query and context stand in for them."""
    t, s = batch.num_tokens, len(batch.query_lens)
    key = (int_class(t), t <= 16, int_class(s), batch.from_start and max(batch.query_lens) > 1)
    if not plan_fns:
        return key + (max(batch.query_lens).bit_length(), max(batch.seq_lens).bit_length())
    return key + tuple(fn(batch) for fn in plan_fns)


def warmup_plan(max_tokens: int, max_seqs: int, max_model_len: int, graph_sizes: tuple[int, ...],
                plan_fns: tuple[PlanFn, ...] = (), block_size: int = 16) -> list[WarmupBatch]:
    """One batch per distinct eager_signature, smallest first; decode-only batches that a CUDA
    graph serves (S <= the largest graph size) are left to the graph capture."""
    largest_graph = max(graph_sizes, default=0)
    chosen: dict[tuple, WarmupBatch] = {}
    for batch in candidate_batches(max_tokens, max_seqs, max_model_len, block_size):
        if max(batch.query_lens) == 1 and len(batch.query_lens) <= largest_graph:
            continue
        key = eager_signature(batch, plan_fns)
        if key not in chosen or batch.num_tokens < chosen[key].num_tokens:
            chosen[key] = batch
    return sorted(chosen.values(), key=lambda b: (b.num_tokens, len(b.query_lens), max(b.seq_lens)))


def block_table_width_fn(block_size: int) -> PlanFn:
    """The int class of the block table's row stride (its width: the longest context in blocks),
    an argument attention specializes on."""
    return lambda b: int_class(-(-max(b.seq_lens) // block_size))


def _kernel_plan_fns(runner) -> tuple[PlanFn, ...]:
    """The kernels' own plan choices for a batch on this runner (attention launches; the MoE tile
    config when the model has experts); empty when the kernels' plan functions are not there."""
    import torch

    try:
        from tandem.kernels.triton.attention import _launch_plans
        from tandem.kernels.triton.moe import _config as moe_config
    except ImportError:
        return ()
    a = runner.attention_layers[0]
    q = torch.empty(1, 1, 1, dtype=runner.dtype, device=runner.device)

    def attention(b: WarmupBatch) -> tuple:
        plans = _launch_plans(q.expand(b.num_tokens, a.num_heads, a.head_dim), a.num_heads // a.num_kv_heads,
                              len(b.query_lens), a.num_kv_heads, max(b.query_lens), max(b.seq_lens), b.from_start)
        return tuple(tuple(sorted(p.items())) for p in plans)

    fns = (attention, block_table_width_fn(runner.block_size))
    fp8 = next((m for m in runner.model.modules() if hasattr(m, "fp8_block") and hasattr(m, "weight_scale")), None)
    if fp8 is not None:  # the FP8 GEMM's tile family by rows (decode-tile row buckets, prefill tiles)
        from tandem.kernels.triton.fp8 import plan_key
        fns += (lambda b: plan_key(b.num_tokens, fp8.fp8_block),)
    moe = next((m for m in runner.model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")), None)
    if moe is None:
        return fns
    local_experts = len(getattr(moe, "expert_ids", None) or range(moe.num_experts))
    return fns + (lambda b: tuple(sorted(moe_config(b.num_tokens * moe.top_k, local_experts,
                                                    runner.dtype).items())),)


def _forward(runner, batch: WarmupBatch) -> None:
    """One eager step of `batch` over the real KV cache, storing nothing (slots -1, every block 0)."""
    import torch

    from tandem.engine.forward_context import ForwardContext

    dev, bs = runner.device, runner.block_size
    q_lens, s_lens = batch.query_lens, batch.seq_lens
    positions = [p for q, s in zip(q_lens, s_lens) for p in range(s - q, s)]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    ctx = ForwardContext(
        slot_mapping=torch.full((batch.num_tokens,), -1, dtype=torch.long, device=dev),
        block_tables=torch.zeros(len(q_lens), -(-max(s_lens) // bs), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        max_query_len=max(q_lens), max_seq_len=max(s_lens), prefills_from_start=batch.from_start)
    ids = torch.zeros(batch.num_tokens, dtype=torch.long, device=dev)
    hidden = runner.model(ids, torch.tensor(positions, device=dev), ctx)
    runner.model.compute_logits(hidden[torch.tensor(starts[1:], device=dev) - 1])


def compile_ahead(runner, graph_sizes: tuple[int, ...]) -> int:
    """Run the warm-up plan on `runner` (a ModelRunner with its KV cache allocated), then the LM
    head and the sampling argmax for every interesting count of sampled rows. Returns the number
    of batches run. Every TP rank runs the same list, so collectives line up."""
    import torch
    from tqdm import tqdm

    from tandem.engine.parallel import tp_rank
    from tandem.kernels.sampling import argmax

    sched = runner.config.scheduler
    max_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs)
    batches = warmup_plan(max_tokens, sched.max_num_seqs, runner.max_model_len, graph_sizes,
                          _kernel_plan_fns(runner), runner.block_size)
    rows = interesting_counts(sched.max_num_seqs)
    hidden_size = runner.hf_config.hidden_size
    with torch.inference_mode():
        for batch in tqdm(batches, desc="compiling kernels (eager step shapes)", unit="step",
                          disable=tp_rank() != 0):
            _forward(runner, batch)
        for n in rows:  # logits of n rows, greedy and sampled paths both end in this argmax
            logits = runner.model.compute_logits(torch.zeros(n, hidden_size, dtype=runner.dtype,
                                                             device=runner.device)).float()
            argmax(logits)
            argmax(logits.softmax(dim=-1).div(torch.empty_like(logits).exponential_()))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("compile-ahead: %d eager step shapes and %d sampled-row counts run", len(batches), len(rows))
    return len(batches)

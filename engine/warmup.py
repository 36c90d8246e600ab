"""Compile-ahead: run, before the server reports ready, one eager forward pass (and the sampling
argmax) for every kernel variant an eager step of the scheduler can need, so no request waits
for a Triton compile while serving. Decode-only steps replay CUDA graphs, captured at start-up.

What makes Triton build a new variant of a kernel: a different value of a constexpr (tile plans
chosen from token counts: attention's narrow/wide/split launches, the MoE tile config by pairs,
the skinny GEMM under 16 rows, the FP8 GEMM's row buckets), and for plain int arguments the
class of the value (== 1, divisible by 16, other) unless the argument is marked do_not_specialize.
So a step's variant is a function of its token count, sequence count, longest query and context,
and whether every prefill starts at position 0 (attention then reads the new keys densely). `eager_signature`
maps a batch to the set of variants its launches need (each launch compiles on its own),
calling the kernels' own plan functions; the warm-up enumerates a grid of batches the scheduler
can form within its limits and runs each one that needs a variant no earlier one did.
kernels/compile_watch.py counts what still compiles after ready.
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
    """Steps the scheduler can form, for T tokens over S sequences: S - 1 decodes and one prompt
    chunk of T - S + 1 tokens, and S chunks of about T / S tokens each (the longest query the
    count allows, and the shortest); chunks either from position 0 or behind a context, contexts
    at powers of two up to max_model_len, one block and one token short of each and one block
    past (block tables of every width class with every split count). Decode-only batches appear when S = T."""
    powers = [1 << k for k in range(4, max_model_len.bit_length() + 1)]
    contexts = sorted({min(max_model_len, c) for p in powers for c in (p - block_size, p - 1, p, p + block_size)} | {max_model_len})
    for t in interesting_counts(max_tokens):
        for s in interesting_counts(min(max_seqs, t)):
            one_chunk = t - s + 1
            shapes = [((1,) * (s - 1) + (one_chunk,), s - 1)] if one_chunk <= max_model_len else []
            if s > 1 and -(-t // s) <= max_model_len:
                shapes.append((tuple(t // s + (i < t % s) for i in range(s)), 0))
            for q, num_decodes in shapes:
                for ctx in contexts:
                    if ctx < max(q):
                        continue
                    decode_ctx = (ctx,) * num_decodes
                    # the chunks from position 0 (each its own length) or behind ctx - chunk tokens
                    yield WarmupBatch(q, decode_ctx + q[num_decodes:])
                    if ctx > max(q):
                        yield WarmupBatch(q, (ctx,) * s)


PlanFn = Callable[[WarmupBatch], tuple]  # a batch -> the variant keys of one kernel's launches


def eager_signature(batch: WarmupBatch, plan_fns: tuple[PlanFn, ...] = ()) -> frozenset:
    """The kernel variants a batch's eager step compiles (see the module docstring), as a set of
    components: one for the plain kernels (the int classes of the token and sequence counts,
    whether the skinny GEMM path applies (<= 16 rows), dense prefill keys) and one per launch each
    plan function reports. Launches compile independently, so a batch is covered once each of its
    components has been warmed by some batch; without plan functions, the powers of two of the
    longest query and context stand in for them."""
    t, s = batch.num_tokens, len(batch.query_lens)
    step = ("step", int_class(t), t <= 16, int_class(s), batch.from_start and max(batch.query_lens) > 1)
    if not plan_fns:
        return frozenset({step + (max(batch.query_lens).bit_length(), max(batch.seq_lens).bit_length())})
    return frozenset({step} | {(i, launch) for i, fn in enumerate(plan_fns) for launch in fn(batch)})


def warmup_plan(max_tokens: int, max_seqs: int, max_model_len: int, graph_sizes: tuple[int, ...],
                plan_fns: tuple[PlanFn, ...] = (), block_size: int = 16) -> list[WarmupBatch]:
    """Candidate batches, smallest token count first, each kept when it warms a component no
    kept batch has; decode-only batches that a CUDA graph serves (S <= the largest graph size)
    are left to the graph capture."""
    largest_graph = max(graph_sizes, default=0)
    candidates = sorted(candidate_batches(max_tokens, max_seqs, max_model_len, block_size),
                        key=lambda b: (b.num_tokens, len(b.query_lens), max(b.seq_lens)))
    warmed: set = set()
    chosen = []
    for batch in candidates:
        if max(batch.query_lens) == 1 and len(batch.query_lens) <= largest_graph:
            continue
        new = eager_signature(batch, plan_fns) - warmed
        if new:
            warmed |= new
            chosen.append(batch)
    return chosen


def attention_plan_fn(launch_plans: Callable, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype, block_size: int, device=None, quant_out: Callable | None = None,
                      early_out: Callable | None = None) -> PlanFn:
    """Per attention launch of a batch: its plan (tiles, splits, q range), and the int classes of
    the arguments it specializes on: the sequence count and the block table's row stride (its
    width: the longest context in blocks); with quant_out (the layer's: q [T, ...] -> spec or None),
    whether the launch writes its output quantized; with early_out (the layer's: q -> bool) whether its split
    merge lets the next launch in early. device: the GPU whose SM count the plans use."""
    import torch

    q = torch.empty(1, 1, 1, dtype=dtype, device=device)

    def launches(b: WarmupBatch) -> tuple:
        rows = q.expand(b.num_tokens, num_heads, head_dim)
        plans = launch_plans(rows, num_heads // num_kv_heads, len(b.query_lens), num_kv_heads, max(b.query_lens),
                             max(b.seq_lens), b.from_start)
        args = (int_class(len(b.query_lens)), int_class(-(-max(b.seq_lens) // block_size)),
                quant_out is not None and quant_out(rows) is not None, early_out is not None and early_out(rows))
        return tuple((tuple(sorted(p.items())),) + args for p in plans)
    return launches


def _kernel_plan_fns(runner) -> tuple[PlanFn, ...]:
    """The kernels' own plan choices for a batch on this runner (attention launches; the MoE tile
    config when the model has experts); empty when the kernels' plan functions are not there."""
    try:
        from tandem.kernels.triton.attention import _launch_plans
        from tandem.kernels.triton.moe import _config as moe_config
    except ImportError:
        return ()
    a = runner.attention_layers[0]
    fns = (attention_plan_fn(_launch_plans, a.num_heads, a.num_kv_heads, a.head_dim, runner.dtype, runner.block_size,
                             runner.device, getattr(a, "quant_out", None), getattr(a, "early_out", None)),)
    fp8 = next((m for m in runner.model.modules() if hasattr(m, "fp8_block") and hasattr(m, "weight_scale")), None)
    if fp8 is not None:  # the FP8 GEMM's tile family by rows (decode-tile row buckets, prefill tiles)
        from tandem.kernels.triton.fp8 import plan_key
        fns += (lambda b: (plan_key(b.num_tokens, fp8.fp8_block),),)
    moe = next((m for m in runner.model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")), None)
    if moe is None:
        return fns
    local_experts = len(getattr(moe, "expert_ids", None) or range(moe.num_experts))
    return fns + (lambda b: ((tuple(sorted(moe_config(b.num_tokens * moe.top_k, local_experts,
                                                      runner.dtype).items())), int_class(b.num_tokens)),),)


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

"""Compile-ahead (engine/warmup.py) and the compile counter (kernels/compile_watch.py) on CPU.

References: (1) coverage: random batches the scheduler can form, keyed with the kernels' own
attention plan function (H100 SM count on CPU), must all have a key the warm-up ran; (2) the
warm-up forward passes store nothing: the KV cache stays zero and greedy output equals that of
an engine built without them; (3) the counter: Triton's hook slot holds ours, and calls to it
count only after ready."""
import random

import pytest
import torch

from tandem.engine.warmup import (WarmupBatch, _kernel_plan_fns, attention_plan_fn, compile_ahead, eager_signature,
                                  int_class, interesting_counts, warmup_plan)
from tandem.kernels.compile_watch import CompileWatch
from tests.engine.conftest import build_tiny_model

GRAPHS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def test_interesting_counts_cover_every_class_and_power_of_two():
    counts = interesting_counts(300)
    assert counts[:17] == list(range(1, 18)) and counts[-1] == 300
    for p in (16, 32, 64, 128, 256):
        assert {p - 1, p, p + 1} <= set(counts)
    assert {int_class(c) for c in counts} == {"one", "d16", "any"}


def _attention_plans(num_heads: int, num_kv_heads: int, head_dim: int):
    from tandem.kernels.triton.attention import _launch_plans

    return attention_plan_fn(_launch_plans, num_heads, num_kv_heads, head_dim, torch.bfloat16, 16)


def _random_batch(rng: random.Random, max_tokens: int, max_seqs: int, max_len: int) -> WarmupBatch | None:
    small = rng.random() < 0.5
    s = rng.randint(1, 24 if small else max_seqs)
    num_decodes = rng.randint(0, s)
    chunks = s - num_decodes
    cap = 64 if small else max(2, (max_tokens - num_decodes) // max(1, chunks))
    q = [1] * num_decodes + [min(max_len, rng.randint(2, max(2, cap))) for _ in range(chunks)]
    if sum(q) > max_tokens or (chunks == 0 and s <= GRAPHS[-1]):
        return None
    fresh = rng.random() < 0.5
    ctx_cap = 300 if small else max_len
    seq = [rng.randint(2, ctx_cap) for _ in range(num_decodes)]
    seq += [n if fresh else rng.randint(n, max(n, ctx_cap)) for n in q[num_decodes:]]
    return WarmupBatch(tuple(q), tuple(seq))


@pytest.mark.parametrize("heads,max_seqs,max_len", [((32, 8, 128), 256, 4096), ((32, 4, 128), 256, 4096),
                                                    ((8, 4, 64), 64, 1024)],
                         ids=["llama-8b", "qwen3-30b-a3b", "default-model"])
def test_warmup_plan_covers_random_scheduler_batches(heads, max_seqs, max_len):
    fns = (_attention_plans(*heads),)
    plan = warmup_plan(8192, max_seqs, max_len, GRAPHS, fns)
    assert 20 < len(plan) < 400  # one eager pass each at start-up: it must stay cheap
    assert all(b.num_tokens <= 8192 and len(b.query_lens) <= max_seqs and max(b.seq_lens) <= max_len for b in plan)
    warmed = frozenset().union(*(eager_signature(b, fns) for b in plan))
    rng, checked = random.Random(0), 0
    while checked < 3000:
        batch = _random_batch(rng, 8192, max_seqs, max_len)
        if batch is not None:
            checked += 1
            assert eager_signature(batch, fns) <= warmed, (batch, eager_signature(batch, fns) - warmed)


def test_decode_only_batches_are_left_to_the_graphs():
    plan = warmup_plan(512, 64, 256, GRAPHS)
    assert not [b for b in plan if max(b.query_lens) == 1]
    eager_decodes = [b for b in warmup_plan(512, 64, 256, ()) if max(b.query_lens) == 1]
    assert eager_decodes  # --enforce-eager: decode batches are warmed too


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_compile_ahead_stores_nothing_and_changes_no_output(arch, tmp_path):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    build_tiny_model(arch, tmp_path)
    kw = dict(device="cpu", max_model_len=96, max_num_batched_tokens=48, max_num_seqs=6, num_gpu_blocks_override=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    want = LLM(str(tmp_path), **kw).generate(prompts, params)
    llm = LLM(str(tmp_path), **kw)
    runner = llm.engine.runner
    n = compile_ahead(runner, ())
    assert n == len(warmup_plan(48, 6, 96, (), _kernel_plan_fns(runner), runner.block_size)) > 10
    assert torch.count_nonzero(runner.kv_cache) == 0
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_compile_watch_counts_after_ready(caplog):
    watch = CompileWatch()
    assert watch.install()
    import triton

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
        hook = knobs.jit_post_compile_hook
        try:
            hook(key="k", repr="_paged_attention_kernel[num_warps=4](...)", fn=None, compile={},
                 is_manual_warmup=False, already_compiled=False)
            assert (watch.total, watch.after_ready) == (1, 0)
            watch.mark_ready()
            hook(key="k2", repr="_paged_attention_kernel[num_warps=8](...)", fn=None, compile={},
                 is_manual_warmup=False, already_compiled=False)
        finally:
            knobs.jit_post_compile_hook = None
    else:
        watch.record("x")
        watch.mark_ready()
        watch.record("x")
    assert (watch.total, watch.after_ready) == (2, 1)
    assert "kernel compiled after the server was ready" in caplog.text


def test_server_metric_counts_engine_compilations():
    from tandem.engine.protocol import SchedulerStats
    from tandem.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    line = 'tandem:kernel_compilations_after_ready_total{model_name="m"}'
    assert f"{line} 0.0" in m.render().decode()
    m.set_engine_stats(SchedulerStats(num_kernel_compilations_after_ready=3))
    m.set_engine_stats(SchedulerStats(num_kernel_compilations_after_ready=3))  # a snapshot, not a delta
    assert f"{line} 3.0" in m.render().decode()

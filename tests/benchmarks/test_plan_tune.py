"""benchmarks.plan_tune's search (plan neighbourhoods, coordinate descent) against hand-made cost
functions; the GPU part (recapture, check, replay timing) runs only on a device. No timing asserted."""
import pytest

from benchmarks.plan_tune import (attention_neighbours, descend, gemm_neighbours, gemm_start, moe_neighbours,
                                  skinny_neighbours)
from tandem.kernels.triton.fp8_skinny import _plan
from tandem.kernels.triton.moe import W8A16_PAIRS


def test_gemm_neighbours_move_one_knob_and_keep_plans_valid():
    start = _plan(64, 128, 4, False, 4, swap=True)
    near = gemm_neighbours(start, 4096, 128)
    assert start not in near and len(near) == len({tuple(sorted(p.items())) for p in near})
    for p in near:
        changed = {k for k in set(p) | set(start) if p.get(k) != start.get(k)}
        # one knob, or SWAP off (which may carry no other change) / on (strip and warps to its minimum)
        assert len(changed) == 1 or "SWAP" in changed, (p, changed)
        assert 4096 % (p["SPLIT_K"] * p["BLOCK_K"]) == 0
        assert p["BLOCK_K"] == 128  # block-scaled: the K tile is the K block
        if p.get("SWAP"):
            assert p["BLOCK_N"] >= 64 and p["num_warps"] >= 4
    assert dict(start, SPLIT_K=2) in near and dict(start, SPLIT_K=8) in near
    assert dict(start, QUANT=True) in near
    assert {k: v for k, v in start.items() if k != "SWAP"} in near


def test_gemm_neighbours_of_a_non_swap_plan_include_its_swap_form():
    start = _plan(16, 128, 16, True, 2)
    near = gemm_neighbours(start, 4096, 128)
    assert dict(start, SWAP=True, BLOCK_N=64, num_warps=4) in near
    assert all(p["SPLIT_K"] * 128 <= 4096 for p in near)
    assert dict(start, SPLIT_K=32) not in near  # past the splits tried


def test_16_row_neighbours_move_the_tiles_before_the_wait():
    start = dict(_plan(128, 128, 8, True, 4, swap=True), num_stages=1, PRELOAD=4)  # (an 8B qkv plan)
    near = gemm_neighbours(start, 4096, 128, preload=True)
    assert dict(start, PRELOAD=3) in near and dict(start, num_stages=2) in near
    assert all(p.get("PRELOAD", 1) in (1, 2, 3, 4) for p in near)
    assert not any(p.get("PRELOAD") != 4 for p in gemm_neighbours(start, 4096, 128))  # (64 rows: plan() sets it)


def test_walks_start_from_the_plan_the_gemm_runs():
    from tandem.kernels.triton import fp8_skinny
    assert gemm_start((16, 6144, 4096, 128))["PRELOAD"] == 4  # (the table's 8B qkv plan, before: dropped)
    assert gemm_start((16, 6144, 4096, 128)) == fp8_skinny.PLANS[(16, 6144, 4096, 128)]
    assert "PRELOAD" not in gemm_start((64, 6144, 4096, 128))


def test_per_channel_neighbours_try_k_tiles():
    start = _plan(64, 256, 1, False, 4, swap=True)
    near = gemm_neighbours(start, 2048, None)
    assert dict(start, BLOCK_K=128) in near and dict(start, BLOCK_K=512) in near


def test_skinny_neighbours_keep_the_split_within_k():
    from tandem.kernels.triton.linear import _config
    start = _config(128, 2048, 132)  # the Qwen3-30B-A3B router gate
    near = skinny_neighbours(start, 2048)
    assert near and start not in near
    assert all(p["SPLIT_K"] * p["BLOCK_K"] <= 2048 for p in near)
    assert all(sum(p[k] != start[k] for k in start) == 1 for p in near)
    assert dict(start, num_warps=4) in near


def test_moe_neighbours_move_one_knob_each():
    start = dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_N2=64, BLOCK_K=128, num_warps=2, num_stages=4)
    near = moe_neighbours(start)
    assert dict(start, BLOCK_N1=16) in near and dict(start, BLOCK_N1=64) in near
    assert dict(start, num_warps2=1) in near  # the second GEMM's own warps, next to the shared 2
    assert all(dict(start, num_stages=n) in near and dict(start, num_stages2=n) in near
               for n in (2, 3, 5, 6, 7, 8))  # every stage count, each GEMM: not only the neighbours
    assert dict(start, num_stages2=4) not in near  # (the shared count: the same plan)
    assert all(sum(p.get(k) != start.get(k) for k in set(p) | set(start)) == 1 for p in near)
    assert moe_neighbours(W8A16_PAIRS)  # the table's plan has every knob the search moves


def test_attention_neighbours_move_one_knob_each():
    start = dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=0, KV_AHEAD=False, NUM_SPLITS=16, PIN_K=False,
                 KV_PREFETCH=False, KV_READBACK=False)
    near = attention_neighbours(start)
    assert dict(start, BLOCK_N=64) in near and dict(start, num_warps=8) in near and dict(start, num_stages=4) in near
    assert dict(start, PIN_K=True) in near and dict(start, KV_PREFETCH=True) in near
    assert dict(start, KV_READBACK=True) in near
    assert dict(start, maxnreg=96) in near and dict(start, KV_AHEAD=True) in near
    assert dict(start, NUM_SPLITS=8) in near and dict(start, NUM_SPLITS=32) in near
    ahead = dict(start, KV_AHEAD=True, num_stages=1)  # the one plan that moves two knobs: KV_AHEAD as it runs
    assert all(dict(start, num_stages=n) in near for n in (1, 2, 4, 5))  # every other stage count
    assert ahead in near and len(near) == 15  # (128 keys, no cap, KV_AHEAD, PIN_K, KV_PREFETCH, KV_READBACK: one
    # side each)
    assert all(sum(p[k] != start[k] for k in start) == 1 for p in near if p != ahead) and start not in near
    capped = attention_neighbours(dict(start, maxnreg=128, num_stages=2))
    assert dict(start, KV_AHEAD=True, num_stages=1, maxnreg=168) in capped
    assert not any(p["KV_AHEAD"] and p["num_stages"] == 1 and p["maxnreg"] == 168
                   for p in attention_neighbours(dict(start, KV_AHEAD=True)))  # no bundle from KV_AHEAD on


def _times(cost):
    """A time_many over a cost table: plans failing their check (cost None) time as None."""
    calls = []

    def time_many(plans):
        calls.append([p["x"] for p in plans])
        return [cost(p["x"]) for p in plans]
    return time_many, calls


def test_descend_walks_to_the_minimum_and_skips_failed_plans():
    # cost: distance of x from 5; plans at x = 3 fail their check
    time_many, calls = _times(lambda x: None if x == 3 else abs(x - 5) * 10.0 + 100)

    def neighbours(p):
        return [dict(x=x) for x in (p["x"] - 1, p["x"] + 1, p["x"] + 2) if 0 <= x < 10]

    best, us, tried = descend(dict(x=1), neighbours, time_many, min_gain=0.005, max_rounds=8)
    assert best == dict(x=5) and us == 100
    assert [c[0] for c in calls] == [1, 2, 4, 5]  # each round times its incumbent first
    candidates = [x for c in calls for x in c[1:]]
    assert len(candidates) == len(set(candidates)) and not set(candidates) & {1}  # none timed twice
    assert (dict(x=3), None) in tried


def test_descend_retimes_the_incumbent_each_round():
    # the clock drifts: every round is 10% slower than the one before; the plans' true costs differ
    # by 5%, so only comparing inside a round finds the faster one
    rounds = []

    def time_many(plans):
        rounds.append([p["x"] for p in plans])
        drift = 1.1 ** len(rounds)
        return [(100.0 - 5 * p["x"]) * drift for p in plans]

    best, _, _ = descend(dict(x=0), lambda p: [dict(x=p["x"] + 1)] if p["x"] < 2 else [], time_many, 0.01)
    assert best == dict(x=2) and rounds == [[0, 1], [1, 2], [2]]


def test_descend_needs_the_minimum_gain_to_move():
    time_many, _ = _times(lambda x: 100.0 - x * 0.1)
    best, us, _ = descend(dict(x=0), lambda p: [dict(x=1)], time_many, min_gain=0.01)
    assert best == dict(x=0) and us == 100.0
    with pytest.raises(RuntimeError, match="failed its check"):
        descend(dict(x=0), lambda p: [dict(x=1)], _times(lambda x: None)[0], min_gain=0.01)


def test_attention_hook_overrides_decode_launches_only_while_installed():
    import torch

    from benchmarks.plan_tune import DecodeAttentionPlan
    from tandem.kernels.triton import attention
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)  # (a CPU tensor: the rule's CUDA-only caps stay off)
    rule = attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0]
    hook = DecodeAttentionPlan()
    try:
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == rule  # nothing set yet
        assert hook.seen == dict(BLOCK_N=rule["BLOCK_N"], num_warps=rule["num_warps"],
                                 num_stages=rule["num_stages"], maxnreg=0, KV_AHEAD=False,
                                 NUM_SPLITS=rule["NUM_SPLITS"], PIN_K=False, KV_PREFETCH=False, KV_READBACK=True)
        hook.override = dict(hook.seen, BLOCK_N=64, maxnreg=0)
        p = attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0]
        assert p == dict(rule, BLOCK_N=64)  # (maxnreg 0: no cap, no key; KV_AHEAD False: no key)
        hook.override = dict(hook.seen, KV_AHEAD=True, num_stages=1)
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == dict(rule, KV_AHEAD=True, num_stages=1)
        hook.override = dict(hook.seen, NUM_SPLITS=8)  # the split count too (its partials sized from the plan)
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == dict(rule, NUM_SPLITS=8)
        hook.override = dict(hook.seen, PIN_K=True)
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == dict(rule, PIN_K=True)
        hook.override = dict(hook.seen, KV_PREFETCH=True)
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == dict(rule, KV_PREFETCH=True)
        hook.override = dict(hook.seen, KV_READBACK=False)  # (False: the key left out, the rule's True undone)
        assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == {
            k: v for k, v in rule.items() if k != "KV_READBACK"}
        mixed = attention._launch_plans(q, 4, 2, 8, 37, 8192, False, 1)  # a batch with a prefill: left alone
        hook.override = None
        assert mixed == attention._launch_plans(q, 4, 2, 8, 37, 8192, False, 1)
    finally:
        hook.restore()
    assert attention._launch_plans(q, 4, 1, 8, 1, 8192, False, 1)[0] == rule

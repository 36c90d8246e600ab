"""FP8 decode tile plans chosen inside the decode step: each plan is timed by the step's own graph replay.

The plan tables (kernels/triton/fp8_skinny.py PLANS, kernels/triton/linear.py SKINNY_PLANS and its rule,
kernels/triton/moe.py W8A16_PAIRS) were measured one GEMM at a time on cold weights (benchmarks.fp8_gemm,
benchmarks.fp8_moe, benchmarks.kernels), and the decode attention's plan is a rule
(kernels/triton/attention.py). In the step each kernel runs between others
with PDL, so its best plan may differ. This builds one model of `benchmarks.roofline.MODELS` with
dummy weights, runs `--batch` sequences to `--context` tokens, records which GEMM plan keys the
step uses, then per FP8 key, per bf16 key (the MoE router, the LM head, a bf16 model's layers), then the
W8A16 expert plan of an MoE model, then the decode attention
walks to the best neighbouring plan by coordinate descent: each round captures the step's graph once
with the current plan and once with each neighbour (strip width, K split, warps, stages, in-GEMM
quantization, SWAP tiles), drops a capture whose logits are far off the first one's, and times the
graphs in turns (`--rounds` x `--reps` replays, median of the rounds' medians; the current plan is
re-timed in every round, so clock drift between rounds does not pass for a gain); a move needs
`--min-gain`. Each key keeps its best plan while the next is tuned. Nothing is written into the
tables: the output lists the plans to put there, with replay times to be confirmed by an A/B of
`benchmarks.roofline`.

  python -m benchmarks.plan_tune --model qwen3-30b-a3b --fp8 block --kv-cache-dtype fp8 --batch 1 --out t.json
"""
import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.roofline import build, copy_bandwidth, decode_step_args, kernel_flags, kernel_kwargs

# the expert plan's knobs and the values tried next to the current one
MOE_KNOBS = {"BLOCK_N1": (16, 32, 64, 128), "BLOCK_N2": (32, 64, 128), "BLOCK_K": (32, 64, 128),
             "num_warps": (1, 2, 4, 8), "num_warps2": (1, 2, 4, 8), "num_stages": (2, 3, 4, 5, 6, 7, 8),
             "num_stages2": (2, 3, 4, 5, 6, 7, 8)}
MOE_EVERY = ("num_stages", "num_stages2")  # knobs tried at every value, not only the neighbours


def _near(values: tuple, current) -> list:
    """The values next to `current` in the ordered `values` (both sides, or the two nearest when
    current is not among them)."""
    if current in values:
        i = values.index(current)
        return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return sorted(values, key=lambda v: abs(v - current))[:2]


def _others(values: tuple, current) -> list:
    """Every value but `current` (for knobs that do not act in order)."""
    return [v for v in values if v != current]


def gemm_start(key: tuple) -> dict:
    """The decode-tile plan a walk over FP8 key (row bucket, N, K, K block) starts from: the one the GEMM
    runs now, as the table would hold it (plan() sets PRELOAD at 64 rows whatever the table says, so
    that walk leaves it out; a 16-row plan keeps its own)."""
    from tandem.kernels.triton import fp8_skinny
    bucket = key[0]
    return {name: v for name, v in fp8_skinny.plan(*key).items() if not (bucket == 64 and name == "PRELOAD")}


def gemm_neighbours(p: dict, k: int, block_k: int | None, preload: bool = False) -> list[dict]:
    """Plans one step away from decode-tile plan p (kernels/triton/fp8_skinny.py) for a weight of K
    columns (block_k: its K block, None per-channel): strip width, split, warps, stages, QUANT and
    SWAP each moved alone, and with `preload` (the 16-row tile, whose plans set it) the weight tiles
    loaded before the PDL wait (PRELOAD 1-4). Every plan keeps split * BLOCK_K dividing K and SWAP
    strips >= 64."""
    swap = p.get("SWAP", False)
    out = []

    def add(**change):
        q = dict(p, **change)
        if not q.get("SWAP"):
            q.pop("SWAP", None)
        if q != p and q not in out and k % (q["SPLIT_K"] * q["BLOCK_K"]) == 0 \
                and (not q.get("SWAP") or (q["BLOCK_N"] >= 64 and q["num_warps"] >= 4)):
            out.append(q)

    for bn in _near((64, 128) if swap else (16, 32, 64, 128), p["BLOCK_N"]):
        add(BLOCK_N=bn)
    for split in _near((1, 2, 4, 8, 16), p["SPLIT_K"]):
        add(SPLIT_K=split)
    for warps in _near((2, 4, 8), p["num_warps"]):
        add(num_warps=warps)
    for stages in _near((1, 2, 3, 4, 5, 6), p["num_stages"]):
        add(num_stages=stages)
    if preload:
        for tiles in _near((1, 2, 3, 4), p.get("PRELOAD", 1)):
            add(PRELOAD=tiles)
    if block_k is None:
        for bk in _near((128, 256, 512), p["BLOCK_K"]):
            add(BLOCK_K=bk)
    add(QUANT=not p["QUANT"])
    add(SWAP=not swap, BLOCK_N=max(64, p["BLOCK_N"]) if not swap else p["BLOCK_N"],
        num_warps=max(4, p["num_warps"]) if not swap else p["num_warps"])
    return out


def moe_neighbours(p: dict) -> list[dict]:
    """W8A16 expert plans one knob away from p (kernels/triton/moe.py W8A16_PAIRS; num_warps2 and
    num_stages2, the second GEMM's own, default to the shared ones). Stage counts are tried at every
    value: at one token each program's K loop is short (Qwen3-30B-A3B w2: 6 tiles of 128, w13: 16), so
    the count that puts all of a program's tiles in flight at once (7 for w2) is a different regime
    from its neighbours, not a step past them."""
    out = []
    for knob, values in MOE_KNOBS.items():
        current = p[knob] if knob in p else p[knob[:-1]]  # (num_warps2 defaults to num_warps)
        for v in (_others if knob in MOE_EVERY else _near)(values, current):
            q = dict(p, **{knob: v})
            if q not in out and q != p:
                out.append(q)
    return out


def descend(start: dict, neighbours, time_many, min_gain: float, max_rounds: int = 3) -> tuple[dict, float, list]:
    """Coordinate descent from plan `start`: each round times the best plan so far together with its
    untried neighbours (time_many(plans) -> [us or None for a plan that failed its check], the
    incumbent first, so drift between rounds cannot pass for a gain) and moves to the fastest
    neighbour while it beats the incumbent by more than min_gain (a fraction). Returns (best plan,
    its us in the last round that timed it, [(plan, us)] of every timing)."""
    best, best_us, tried = start, None, []
    for _ in range(max_rounds):
        cands = [q for q in neighbours(best) if all(q != t for t, _ in tried)]
        times = time_many([best] + cands)
        if times[0] is None:
            raise RuntimeError(f"the plan {best} failed its check")
        best_us = times[0]
        tried += list(zip([best] + cands, times))
        ok = [(q, us) for q, us in zip(cands, times[1:]) if us is not None]
        if not ok:
            break
        q, us = min(ok, key=lambda t: t[1])
        if us >= best_us * (1 - min_gain):
            break
        best, best_us = q, us
    return best, best_us, tried


class StepTimer:
    """Decode-step graphs captured under plan changes, checked against the first capture's logits,
    then timed in turns (rounds x reps replays each, the median of the rounds' medians)."""

    def __init__(self, llm, batch: int, reps: int, rounds: int, tolerance: float):
        self.runner, self.batch, self.reps, self.rounds, self.tolerance = (
            llm.engine.runner, batch, reps, rounds, tolerance)
        self.reference = None
        g = self.runner.graphs  # the last decode step's inputs, put back into each new capture
        self.inputs = [t.clone() for t in (g.tokens, g.block_tables, g.seq_lens)]
        self.runner.graphs = None  # (the engine's own graphs: not needed past this point)
        g.release()

    def capture(self):
        """The step's graph as the tables stand now, or None (it failed to capture or its logits
        are off the reference by more than the tolerance)."""
        from tandem.engine.cuda_graphs import DecodeGraphs
        r = self.runner
        try:
            g = DecodeGraphs(r.model, [self.batch], -(-r.max_model_len // r.block_size), r.max_model_len, r.device)
        except Exception as e:  # a plan the GPU cannot run (shared memory, registers): not a candidate
            print(f"    capture failed ({type(e).__name__}: {str(e)[:200]}): skipped", flush=True)
            return None
        for buf, saved in zip((g.tokens, g.block_tables, g.seq_lens), self.inputs):
            buf.copy_(saved)
        graph, _, logits = g.graphs[self.batch]
        graph.replay()
        torch.cuda.synchronize()
        if self.reference is None:
            self.reference = logits.float().clone()
        err = ((logits.float() - self.reference).abs().max() / self.reference.abs().max().clamp_min(1e-6)).item()
        if not err <= self.tolerance:  # (nan fails too)
            print(f"    logits off the reference by {err:.3g} (relative): skipped", flush=True)
            g.release()
            return None
        return g

    def time_many(self, plans: list, apply) -> list:
        """apply(plan) puts a plan in its table; -> us per replay for each plan (None: failed)."""
        from benchmarks.profile_decode import gpu_time_us
        graphs = []
        for p in plans:
            apply(p)
            graphs.append(self.capture())
        per_round = [[] for _ in plans]
        for _ in range(self.rounds):
            for i, g in enumerate(graphs):
                if g is not None:
                    per_round[i].append(gpu_time_us(g.graphs[self.batch][0].replay, self.reps))
        for g in graphs:
            if g is not None:
                g.release()
        del graphs
        torch.cuda.empty_cache()
        times = [statistics.median(t) if t else None for t in per_round]
        for p, us in zip(plans, times):
            print(f"    {p}: {us if us is None else round(us, 1)}", flush=True)
        return times


def gemm_keys(timer: StepTimer) -> tuple[list, list]:
    """The plan keys one capture of the step asks for (that capture's logits are the reference): the
    FP8 decode tile's (row bucket, N, K, K block) and the bf16 skinny GEMM's (N, K)."""
    from tandem.kernels.triton import fp8_skinny, linear
    fp8_keys, bf16_keys, plan, config = [], [], fp8_skinny.plan, linear._config

    def plan_recorded(m, n, k, block_k, sms=132):
        if (fp8_skinny.row_bucket(m), n, k, block_k) not in fp8_keys:
            fp8_keys.append((fp8_skinny.row_bucket(m), n, k, block_k))
        return plan(m, n, k, block_k, sms)

    def config_recorded(n, k, sms):
        if (n, k) not in bf16_keys:
            bf16_keys.append((n, k))
        return config(n, k, sms)

    fp8_skinny.plan, linear._config = plan_recorded, config_recorded
    try:
        g = timer.capture()
    finally:
        fp8_skinny.plan, linear._config = plan, config
    if g is not None:
        g.release()
    return fp8_keys, bf16_keys


def skinny_neighbours(p: dict, k: int) -> list[dict]:
    """bf16 skinny GEMM plans (kernels/triton/linear.py) one knob away from p for a weight of K
    columns: strip width, split, K tile, warps, stages; split * BLOCK_K stays within K."""
    out = []
    for knob, values in (("BLOCK_N", (16, 32, 64)), ("SPLIT_K", (1, 2, 4, 8, 16)), ("BLOCK_K", (64, 128, 256)),
                         ("num_warps", (1, 2, 4, 8)), ("num_stages", (2, 3, 4, 5, 6))):
        for v in _near(values, p[knob]):
            q = dict(p, **{knob: v})
            if q["SPLIT_K"] * q["BLOCK_K"] <= k and q not in out:
                out.append(q)
    return out


ATTENTION_KNOBS = {"BLOCK_N": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4, 5),
                   "maxnreg": (0, 96, 128, 168, 232), "KV_AHEAD": (False, True),  # maxnreg 0: no register cap
                   "NUM_SPLITS": (1, 2, 4, 8, 16, 32, 64),  # the rule's split-K count, a power of 2 (the merge)
                   "PIN_K": (False, True),  # K's e4m3 conversion in the load's layout (kernels/triton/attention.py)
                   "KV_PREFETCH": (False, True),  # the last tile into L2 ahead of the wait (--no-attention-kv-early)
                   "KV_READBACK": (False, True)}  # with KV_EARLY: the new key read back into that tile from the cache


def attention_neighbours(p: dict) -> list[dict]:
    """Decode attention plans one knob away from p (kernels/triton/attention.py _launch_plans' launch
    for decode batches, split or not): key tile, warps, register cap, KV_AHEAD, split count next to the
    current value, PIN_K, KV_PREFETCH and KV_READBACK flipped; every other stage count, because stages do not act in
    order on a paged loop: Triton (3.6 and 3.9, sm_90 TTGIR) gives the block-table load the first stage
    from 3 stages on, and K/V get a second buffer only at 5 (2: one buffer, the table read in the loop; 3
    and 4: one buffer).
    And, from a plan without KV_AHEAD, KV_AHEAD as it runs: one stage (it pipelines by hand) and at
    least 168 registers (the 64-key tile a thread holds ahead: 800 bytes of spills at the 128 cap, 30
    at 168; ptxas sm_90, 4 warps). One knob at a time would reach that only through slower plans."""
    out = []
    for knob, values in ATTENTION_KNOBS.items():
        out += [dict(p, **{knob: v}) for v in (_others if knob == "num_stages" else _near)(values, p[knob])]
    if not p["KV_AHEAD"]:
        out.append(dict(p, KV_AHEAD=True, num_stages=1, maxnreg=max(p["maxnreg"], 168) if p["maxnreg"] else 0))
    return out


class DecodeAttentionPlan:
    """Overrides the launch plan kernels/triton/attention.py picks for decode batches (one query a
    sequence: one launch, split-K or not) while installed; `seen` is what the rule picked."""

    def __init__(self):
        from tandem.kernels.triton import attention
        self.module, self.plans, self.override, self.seen = attention, attention._launch_plans, None, None

        def plans(q, group, num_seqs, num_kv_heads, max_query_len, *args, **kwargs):
            out = self.plans(q, group, num_seqs, num_kv_heads, max_query_len, *args, **kwargs)
            if max_query_len == 1 and len(out) == 1:
                p = out[0]
                self.seen = {k: p.get(k, 0) for k in ATTENTION_KNOBS}
                p.update(self.override or {})
                for off in (k for k, values in ATTENTION_KNOBS.items() if not values[0]):  # 0 / False: absent
                    if not p.get(off):
                        p.pop(off, None)
            return out

        attention._launch_plans = plans

    def restore(self) -> None:
        self.module._launch_plans = self.plans


def _plan_tables() -> tuple[dict, ...]:
    """The tables of decode plans an engine reads while it captures its graphs."""
    from tandem.kernels.triton import fp8_skinny, linear, moe, routing
    tables = (fp8_skinny.PLANS, linear.SKINNY_PLANS, moe.W8A16_PAIRS, routing.ROUTE_PLANS)
    try:
        from tandem.kernels.triton import fp8_tma, fp8_tma_moe
    except ImportError:  # (no Gluon for Hopper in this Triton)
        return tables
    return (*tables, fp8_tma.PLANS, fp8_tma.RING_PLANS, fp8_tma_moe.FUSED_PLANS)


def _tables(hook: "DecodeAttentionPlan") -> tuple:
    return tuple(dict(t) for t in _plan_tables()) + (hook.override,)


def _put_tables(hook: "DecodeAttentionPlan", tables: tuple) -> None:
    *saved, hook.override = tables
    for table, plans in zip(_plan_tables(), saved):
        table.clear()
        table.update(plans)


def confirm(llm, batch: int, hook: "DecodeAttentionPlan", before: tuple, after: tuple, steps: int) -> dict:
    """Engine step times (EngineCore.step(), median of `steps`) with the tables before and after
    tuning, the engine's graph recaptured for each, alternated twice: before, after, before, after."""
    from benchmarks.profile_decode import recapture
    from benchmarks.roofline import step_times
    core = llm.engine
    out = dict(before_ms=[], after_ms=[])
    for label, tables in (("before", before), ("after", after)) * 2:
        _put_tables(hook, tables)
        recapture(core.runner, batch, True)
        for _ in range(3):
            core.step()
        out[f"{label}_ms"].append(statistics.median(step_times(core, steps)) * 1e3)
        print(f"engine step, tables {label} tuning: {out[f'{label}_ms'][-1]:.3f} ms", flush=True)
    return out


def _walk(label: str, start: dict, neighbours, put, timer: StepTimer, min_gain: float) -> dict:
    """descend from `start` with put(plan) installing a plan; leaves the best installed."""
    best, best_us, tried = descend(start, neighbours, lambda ps: timer.time_many(ps, put), min_gain)
    put(best)  # later knobs are tuned with this one's best in place
    print(f"{label}: {tried[0][1]:.1f} -> {best_us:.1f} us with {best}", flush=True)
    return dict(what=label, start=start, start_us=tried[0][1], best=best, best_us=best_us, tried=len(tried))


def tune(llm, batch: int, reps: int, rounds: int, min_gain: float, tolerance: float, only: list[str],
         confirm_steps: int) -> dict:
    """Walks (descend) the FP8 decode GEMM plans, the bf16 skinny GEMM plans, the W8A16 expert plan
    and the decode attention's launch plan, as `only` names them, in that order."""
    from tandem.kernels.triton import fp8_skinny, linear, moe
    hook = DecodeAttentionPlan()  # (no override until the attention is tuned)
    try:
        before = _tables(hook)
        timer = StepTimer(llm, batch, reps, rounds, tolerance)
        fp8_keys, bf16_keys = gemm_keys(timer)
        print(f"FP8 decode GEMM keys {fp8_keys}; bf16 skinny GEMM keys {bf16_keys}; decode attention plan "
              f"{hook.seen}", flush=True)
        walks = []
        for key in fp8_keys if "gemm" in only else []:
            bucket, n, k, block_k = key
            walks.append(_walk(f"fp8 {key}", gemm_start(key),
                               lambda p, k=k, b=block_k, pre=bucket == 16: gemm_neighbours(p, k, b, pre),
                               lambda p, key=key: fp8_skinny.PLANS.__setitem__(key, p), timer, min_gain))
        for key in bf16_keys if "skinny" in only else []:
            n, k = key
            start = linear._config(n, k, num_sms_of(llm))
            walks.append(_walk(f"bf16 {key}", start, lambda p, k=k: skinny_neighbours(p, k),
                               lambda p, key=key: linear.SKINNY_PLANS.__setitem__(key, p), timer, min_gain))
        if "moe" in only and getattr(llm.engine.runner.model.config, "num_experts", 0):
            def put_moe(p):
                moe.W8A16_PAIRS.clear()
                moe.W8A16_PAIRS.update(p)
            walks.append(_walk("experts", dict(moe.W8A16_PAIRS), moe_neighbours, put_moe, timer, min_gain))
        if "attention" in only and hook.seen is not None:
            walks.append(_walk("decode attention", dict(hook.seen), attention_neighbours,
                               lambda p: setattr(hook, "override", p), timer, min_gain))
        result = dict(walks=walks)
        if confirm_steps:
            result["confirm"] = confirm(llm, batch, hook, before, _tables(hook), confirm_steps)
        return result
    finally:
        hook.restore()


def num_sms_of(llm) -> int:
    from tandem.kernels.triton.device import num_sms
    return num_sms(llm.engine.runner.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode_step_args(ap, fp8="block", kv_cache_dtype="fp8")
    ap.add_argument("--reps", type=int, default=10, help="replays timed per plan and round (median)")
    ap.add_argument("--rounds", type=int, default=5, help="turns over a round's plans (median of medians)")
    ap.add_argument("--only", nargs="+", choices=["gemm", "skinny", "moe", "attention"],
                    default=["gemm", "skinny", "moe", "attention"],
                    help="what to tune: FP8 decode GEMMs, bf16 skinny GEMMs (the MoE router, the LM head, a "
                         "bf16 model's layers), W8A16 experts, decode attention")
    ap.add_argument("--min-gain", type=float, default=0.005, help="a move needs this fraction off the replay")
    ap.add_argument("--tolerance", type=float, default=0.5,
                    help="largest relative difference of the step's logits from the first capture's: a sanity "
                         "check only (a random model's logits move ~20%% with a split's summation order); the "
                         "tables' plans are checked against the torch references by tests/kernels")
    ap.add_argument("--confirm-steps", type=int, default=30,
                    help="then engine steps timed with the tables before / after tuning, alternated (0: none)")
    kernel_flags(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest
    logging.getLogger("tandem.kernels.compile_watch").setLevel(logging.ERROR)  # every plan compiles late here

    bw = copy_bandwidth()
    llm = build(args.model, args.fp8, kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=4096,
                max_num_seqs=max(args.batch, 8), max_model_len=8192, gpu_memory_utilization=0.9,
                cuda_graph_sizes=(args.batch,), async_scheduling=False, **kernel_kwargs(args))
    core = llm.engine
    for i in range(args.batch):
        core.add_request(EngineRequest(f"r{i}", [(i * 7 + j) % 1000 + 1 for j in range(args.context)],
                                       SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(3):  # decode steps: the graph's input buffers hold a real step's
        core.step()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.model} --fp8 {args.fp8} "
          f"b={args.batch} ctx={args.context}", flush=True)
    result = tune(llm, args.batch, args.reps, args.rounds, args.min_gain, args.tolerance, args.only,
                  args.confirm_steps)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), model=args.model, fp8=args.fp8,
            batch=args.batch, context=args.context, copy_GBps=bw / 1e9, **result), indent=1))


if __name__ == "__main__":
    main()

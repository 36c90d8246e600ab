"""FP8 decode tile plans chosen inside the decode step: each plan is timed by the step's own graph replay.

The plan tables (kernels/triton/fp8_skinny.py PLANS, kernels/triton/moe.py W8A16_PAIRS) were measured
one GEMM at a time on cold weights (benchmarks.fp8_gemm, benchmarks.fp8_moe). In the step each GEMM
runs between other kernels with PDL, so its best plan may differ. This builds one model of
`benchmarks.roofline.MODELS` with dummy weights, runs `--batch` sequences to `--context` tokens, records
which decode-GEMM plan keys the step uses, then per key (and the W8A16 expert plan of an MoE model)
walks to the best neighbouring plan by coordinate descent: every neighbour of the current plan (strip
width, K split, warps, stages, in-GEMM quantization, SWAP tiles) is put in the table, the decode graph
recaptured, its output checked against the baseline's (a plan that computes something else is
skipped), and the replay timed (median GPU time); a move needs a gain over `--min-gain`. The others
keep their best plan meanwhile. Nothing is written into the tables: the result lists the plans to
put there, with the replay times.

  python -m benchmarks.plan_tune --model llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 1 --out t.json
"""
import argparse
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.roofline import MODELS, build, copy_bandwidth, kernel_flags, kernel_kwargs

# the expert plan's knobs and the values tried next to the current one
MOE_KNOBS = {"BLOCK_N1": (16, 32, 64, 128), "BLOCK_N2": (32, 64, 128), "BLOCK_K": (32, 64, 128),
             "num_warps": (1, 2, 4, 8), "num_warps2": (1, 2, 4, 8), "num_stages": (2, 3, 4, 5, 6),
             "num_stages2": (2, 3, 4, 5, 6)}


def _near(values: tuple, current) -> list:
    """The values next to `current` in the ordered `values` (both sides, or the two nearest when
    current is not among them)."""
    if current in values:
        i = values.index(current)
        return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return sorted(values, key=lambda v: abs(v - current))[:2]


def gemm_neighbours(p: dict, k: int, block_k: int | None) -> list[dict]:
    """Plans one step away from decode-tile plan p (kernels/triton/fp8_skinny.py) for a weight of K
    columns (block_k: its K block, None per-channel): strip width, split, warps, stages, QUANT and
    SWAP each moved alone. Every plan keeps split * BLOCK_K dividing K and SWAP strips >= 64."""
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
    for stages in _near((2, 3, 4, 5, 6), p["num_stages"]):
        add(num_stages=stages)
    if block_k is None:
        for bk in _near((128, 256, 512), p["BLOCK_K"]):
            add(BLOCK_K=bk)
    add(QUANT=not p["QUANT"])
    add(SWAP=not swap, BLOCK_N=max(64, p["BLOCK_N"]) if not swap else p["BLOCK_N"],
        num_warps=max(4, p["num_warps"]) if not swap else p["num_warps"])
    return out


def moe_neighbours(p: dict) -> list[dict]:
    """W8A16 expert plans one knob away from p (kernels/triton/moe.py W8A16_PAIRS; num_warps2 and
    num_stages2, the second GEMM's own, default to the shared ones)."""
    out = []
    for knob, values in MOE_KNOBS.items():
        current = p[knob] if knob in p else p[knob[:-1]]  # (num_warps2 defaults to num_warps)
        for v in _near(values, current):
            q = dict(p, **{knob: v})
            if q not in out and q != p:
                out.append(q)
    return out


def descend(start: dict, neighbours, time_plan, min_gain: float, max_rounds: int = 3) -> tuple[dict, float, list]:
    """Coordinate descent from plan `start`: time every neighbour of the best plan so far
    (time_plan(plan) -> us, None for a plan that failed its check); move to the fastest while it
    beats the best by more than min_gain (a fraction). Returns (best plan, its us, [(plan, us)])."""
    best, best_us = start, time_plan(start)
    if best_us is None:
        raise RuntimeError(f"the starting plan {start} failed its check")
    tried = [(start, best_us)]
    for _ in range(max_rounds):
        timed = [(q, time_plan(q)) for q in neighbours(best) if all(q != t for t, _ in tried)]
        tried += timed
        ok = [(q, us) for q, us in timed if us is not None]
        if not ok:
            break
        q, us = min(ok, key=lambda t: t[1])
        if us >= best_us * (1 - min_gain):
            break
        best, best_us = q, us
    return best, best_us, tried


class StepTimer:
    """The decode step's graph, recaptured after each plan change, checked and timed."""

    def __init__(self, llm, batch: int, reps: int, tolerance: float):
        from benchmarks.profile_decode import recapture
        self.runner, self.batch, self.reps, self.tolerance = llm.engine.runner, batch, reps, tolerance
        self._recapture = recapture
        self.reference = None
        g = self.runner.graphs  # the last decode step's inputs, put back into each new capture
        self.inputs = [t.clone() for t in (g.tokens, g.block_tables, g.seq_lens)]

    def __call__(self) -> float | None:
        from benchmarks.profile_decode import gpu_time_us
        try:
            self._recapture(self.runner, self.batch, True)
        except Exception as e:  # a plan the GPU cannot run (shared memory, registers): not a candidate
            print(f"    capture failed ({type(e).__name__}: {str(e)[:200]}): skipped", flush=True)
            return None
        g = self.runner.graphs
        for buf, saved in zip((g.tokens, g.block_tables, g.seq_lens), self.inputs):
            buf.copy_(saved)
        graph, hidden, logits = g.graphs[self.batch]
        out = logits if logits is not None else hidden
        graph.replay()
        torch.cuda.synchronize()
        result = out.float().clone()
        if self.reference is None:
            self.reference = result
        err = ((result - self.reference).abs().max() / self.reference.abs().max().clamp_min(1e-6)).item()
        if not err <= self.tolerance:  # (nan fails too)
            print(f"    output off the baseline's by {err:.3g} (relative): skipped", flush=True)
            return None
        return gpu_time_us(graph.replay, self.reps)


def gemm_keys(timer: StepTimer) -> list[tuple]:
    """The decode-tile plan keys (row bucket, N, K, K block) one capture of the step asks for."""
    from tandem.kernels.triton import fp8_skinny
    seen, plan = [], fp8_skinny.plan

    def recording(m, n, k, block_k, sms=132):
        key = (fp8_skinny.row_bucket(m), n, k, block_k)
        if key not in seen:
            seen.append(key)
        return plan(m, n, k, block_k, sms)

    fp8_skinny.plan = recording
    try:
        timer()
    finally:
        fp8_skinny.plan = plan
    return seen


def tune(llm, batch: int, reps: int, min_gain: float, tolerance: float) -> dict:
    from tandem.kernels.triton import fp8_skinny, moe
    timer = StepTimer(llm, batch, reps, tolerance)
    keys = gemm_keys(timer)  # (also the baseline output)
    baseline_us = timer()
    print(f"baseline replay {baseline_us:.1f} us; decode GEMM keys {keys}", flush=True)
    result = dict(baseline_us=baseline_us, gemms=[], moe=None)
    for key in keys:
        bucket, n, k, block_k = key
        had = key in fp8_skinny.PLANS
        start = {name: v for name, v in fp8_skinny.plan(bucket, n, k, block_k).items() if name != "PRELOAD"}

        def time_plan(p, key=key):
            fp8_skinny.PLANS[key] = p
            us = timer()
            print(f"  {key} {p}: {us if us is None else round(us, 1)}", flush=True)
            return us

        best, best_us, tried = descend(start, lambda p: gemm_neighbours(p, k, block_k), time_plan, min_gain)
        fp8_skinny.PLANS[key] = best  # later keys are tuned with this one's best in place
        result["gemms"].append(dict(key=list(key), start=start, start_us=tried[0][1], best=best, best_us=best_us,
                                    was_in_table=had, tried=len(tried)))
        print(f"{key}: {tried[0][1]:.1f} -> {best_us:.1f} us with {best}", flush=True)
    if getattr(llm.engine.runner.model.config, "num_experts", 0):
        start = dict(moe.W8A16_PAIRS)

        def time_moe(p):
            moe.W8A16_PAIRS.clear()
            moe.W8A16_PAIRS.update(p)
            us = timer()
            print(f"  experts {p}: {us if us is None else round(us, 1)}", flush=True)
            return us

        best, best_us, tried = descend(start, moe_neighbours, time_moe, min_gain)
        time_moe(best)
        result["moe"] = dict(start=start, start_us=tried[0][1], best=best, best_us=best_us, tried=len(tried))
        print(f"experts: {tried[0][1]:.1f} -> {best_us:.1f} us with {best}", flush=True)
    result["final_us"] = timer()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--fp8", choices=["block", "channel"], default="block")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="fp8")
    ap.add_argument("--reps", type=int, default=30, help="replays timed per plan (median)")
    ap.add_argument("--min-gain", type=float, default=0.005, help="a move needs this fraction off the replay")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest relative difference of the step's logits from the baseline plan's")
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
                                       SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(3):  # decode steps: the graph's input buffers hold a real step's
        core.step()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.model} --fp8 {args.fp8} "
          f"b={args.batch} ctx={args.context}", flush=True)
    result = tune(llm, args.batch, args.reps, args.min_gain, args.tolerance)
    print(f"replay {result['baseline_us']:.1f} -> {result['final_us']:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), model=args.model, fp8=args.fp8,
            batch=args.batch, context=args.context, copy_GBps=bw / 1e9, **result), indent=1))


if __name__ == "__main__":
    main()

"""A mixed prefill+decode step against its parts: is a step that carries D decodes and a C-token
prompt chunk as fast as a D-decode step plus a C-token prefill step?

For each (D, C), on one engine (dummy weights, synchronous steps; step budget D + C, C prefill-only),
times, per step, median of `--steps` steps each:
  decode   D sequences at ~--context tokens, nothing else;
  prefill  a queue of --context-token prompts, C prompt tokens a step (chunked), nothing else;
  mixed    the same D sequences and such a queue: every step D decode rows + C prompt rows.
Each row also reports the median timed step's (decode rows, prompt tokens) as the scheduler built it.
The table shows the three and mixed / (decode + prefill): above 1 a mixed step costs more than its
parts. Every shape runs once untimed first (compile-ahead is off, as in benchmarks.roofline).

  python -m benchmarks.mixed_step --model qwen3-30b-a3b --decodes 32 64 --chunks 512 2048
"""
import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.roofline import MODELS, build, kernel_flags, kernel_kwargs, step_times


def _request(rid: str, n: int, seed: int, max_tokens: int):
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    # distinct tokens per request: no prefix-cache hits between them
    return EngineRequest(rid, [(seed * 7919 + j * 13) % 30000 + 1 for j in range(n)],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def _clear(core) -> None:
    core.abort_requests(list(core.scheduler.requests))
    while core.has_unfinished_requests():
        core.step()
    core.step()


def _timed(core, steps: int) -> tuple[float, tuple[int, int]]:
    """Median seconds of `steps` steps, and the median step's composition (decode rows, prompt
    tokens): each step's scheduled requests, decodes being the ones with an output token."""
    sched = core.scheduler
    schedule, shapes = sched.schedule, []

    def recorded():
        out = schedule()
        decodes = sum(1 for r, _ in out.scheduled if r.num_output_tokens > 0)
        shapes.append((decodes, out.num_tokens - decodes))
        return out

    sched.schedule = recorded
    try:
        times = step_times(core, steps)
    finally:
        del sched.schedule  # the class's method again
    return statistics.median(times), sorted(shapes)[len(shapes) // 2]


def _budget(core, tokens: int) -> None:
    """The scheduler's step budget (max_num_batched_tokens), within what the engine was built for."""
    core.scheduler.config = dataclasses.replace(core.scheduler.config, max_num_batched_tokens=tokens)


def measure(core, decodes: int, chunk: int, context: int, steps: int, seed: int) -> dict:
    """Median seconds of a decode-only, a prefill-only and a mixed step (see the module doc), and
    each one's (decode rows, prompt tokens). The step budget is D + C with the decodes, C without."""
    # prompts of the decodes' length, enough of them to outlast the timed steps
    prompts = -(-chunk * (steps + 2) // context)
    out, shapes = {}, {}
    _budget(core, decodes + chunk)
    # decode only
    for i in range(decodes):
        core.add_request(_request(f"d{seed}-{i}", context, seed * 1000 + i, 4 * steps + 16))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    out["decode"], shapes["decode"] = _timed(core, steps)
    # mixed: the same decodes plus the prompt queue, C tokens a step
    for k in range(prompts):
        core.add_request(_request(f"p{seed}-{k}", context, seed * 1000 + 500 + k, 1))
    core.step()
    out["mixed"], shapes["mixed"] = _timed(core, steps)
    _clear(core)
    # prefill only
    _budget(core, chunk)
    for k in range(prompts):
        core.add_request(_request(f"q{seed}-{k}", context, seed * 1000 + 700 + k, 1))
    core.step()
    out["prefill"], shapes["prefill"] = _timed(core, steps)
    _clear(core)
    return dict(seconds=out, shapes=shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(MODELS))
    ap.add_argument("--decodes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=12)
    kernel_flags(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # one engine (a finished engine's memory is not all returned); measure() sets the step budget
    # per phase, within the budget the engine was built for
    llm = build(args.model, max_num_batched_tokens=max(args.decodes) + max(args.chunks),
                max_num_seqs=max(args.decodes) + 8, max_model_len=args.context + 4 * args.steps + 64,
                gpu_memory_utilization=0.9, async_scheduling=False, **kernel_kwargs(args))
    rows = []
    seed = 0
    for chunk in args.chunks:
        for decodes in args.decodes:
            measure(llm.engine, decodes, chunk, args.context, 3, seed := seed + 1)  # compile / warm up
            m = measure(llm.engine, decodes, chunk, args.context, args.steps, seed := seed + 1)
            t = m["seconds"]
            row = dict(decodes=decodes, chunk=chunk, **{k: v * 1e3 for k, v in t.items()}, shapes=m["shapes"])
            row["mixed_over_parts"] = t["mixed"] / (t["decode"] + t["prefill"])
            rows.append(row)
            print("measured:", row, flush=True)
    print(f"\n{torch.cuda.get_device_name()} {args.model} context {args.context}")
    print(f"{'decodes':>8}{'chunk':>7}{'decode ms':>11}{'prefill ms':>12}{'mixed ms':>10}{'mixed/parts':>13}"
          f"  mixed step (decode rows, prompt tokens)")
    for r in rows:
        print(f"{r['decodes']:>8}{r['chunk']:>7}{r['decode']:>11.2f}{r['prefill']:>12.2f}{r['mixed']:>10.2f}"
              f"{r['mixed_over_parts']:>13.2f}  {r['shapes']['mixed']}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                                  model=args.model, context=args.context, rows=rows), indent=1))


if __name__ == "__main__":
    main()

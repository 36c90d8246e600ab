"""When each program of the decode layer's attention, its split merge and the FP8 o projection's TMA GEMM
(kernels/triton/fp8_tma.py) runs inside the decode step's CUDA graph: per program the GPU clock (%globaltimer, ns)
at its start, at the release of its PDL wait (the kernels ahead done), (the GEMM's) when all of its weight had
arrived in shared memory, and at its end, and its SM (TRACE; kernels/triton/trace.py).

Why: at batch 1 that GEMM is let in while the attention runs, so its weight can stream before the merge ends, yet
on an H100 it stays exposed ~11 us after the merge for 5.6 us of weight bytes, and takes 9.7 us alone
(benchmarks/RESULTS.md, fortieth session). The stamps tell the causes apart, relative to the release of the
GEMM's wait: programs that only start near it (no room beside the attention), weight that arrives well after its
early request (slow reads), or an end well after the weight (the tail: the split's ticket and the epilogue).

  python -m benchmarks.program_trace --model llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 1

First table, per GEMM launch (one a decoder layer), us against the wait's release (the median program's):
programs, SMs, the most programs an SM held; start, weight in and end as percentiles over the programs; how many
programs started 1 us or more before the release. "Weight in" is when a program, past its wait and its staging
of x, found all of its weight tiles landed: never before the release, and a few tenths of a us past it where the
weight was already there. Then the mean over the layers.

Second table, per layer, the same clock: the attention's programs (those with keys: the rest return before their
wait) from their first start to their last end, the merge's, and how many GEMM programs started while an
attention program was still live on their SM ("beside"). %globaltimer's update interval is the GPU's (up to
1 us on some), fine for gaps of several us.
"""
import argparse
import statistics

import torch

from benchmarks.roofline import decode_step_args, kernel_flags

from tandem.kernels.triton.trace import END, RELEASED, SM, START, WEIGHT_IN


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (linear between the nearest ranks)."""
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q))


def summarize(stamps: torch.Tensor) -> dict:
    """One launch's stamps [programs, 8] int64 (ns) -> us against the release of the wait (the programs' median:
    every program's wait ends when the kernels ahead have, so they differ by the clock's reach across SMs)."""
    rows = stamps.cpu().tolist()
    released = statistics.median(r[RELEASED] for r in rows)

    def rel(col: int) -> list[float]:
        return [(r[col] - released) / 1e3 for r in rows]

    per_sm: dict[int, int] = {}
    for r in rows:
        per_sm[r[SM]] = per_sm.get(r[SM], 0) + 1
    start, weight_in, end = rel(START), rel(WEIGHT_IN), rel(END)
    return dict(programs=len(rows), sms=len(per_sm), most_on_an_sm=max(per_sm.values()),
                started_early=sum(t <= -1.0 for t in start),
                start=[_pct(start, q) for q in (0.0, 0.5, 0.9, 1.0)],
                weight_in=[_pct(weight_in, q) for q in (0.0, 0.5, 0.9, 1.0)],
                end=[_pct(end, q) for q in (0.5, 1.0)],
                weight_after_start=statistics.median(w - s for w, s in zip(weight_in, start)))


def mean_summary(summaries: list[dict]) -> dict:
    """The layers' summaries averaged key by key (lists element by element)."""
    out = {}
    for k, v in summaries[0].items():
        vals = [s[k] for s in summaries]
        out[k] = [statistics.fmean(x) for x in zip(*vals)] if isinstance(v, list) else statistics.fmean(vals)
    return out


def format_row(label: str, s: dict) -> str:
    f = lambda xs: " ".join(f"{x:6.1f}" for x in xs)  # noqa: E731
    return (f"{label:<8}{s['programs']:>5.0f}{s['sms']:>5.0f}{s['most_on_an_sm']:>4.0f}{s['started_early']:>7.0f}"
            f"   {f(s['start'])}   {f(s['weight_in'])}   {f(s['end'])}   {s['weight_after_start']:6.1f}")


HEADER = (f"{'launch':<8}{'progs':>5}{'SMs':>5}{'/SM':>4}{'early':>7}   {'start: min    p50    p90    max':<27}   "
          f"{'weight in: min p50   p90    max':<27}   {'end: p50   max':<13}   in-start")


def layer_timeline(layer: dict[str, torch.Tensor]) -> dict:
    """One layer's launches {"attention", "merge" (absent where the GEMM merges), "tma_gemm": stamps [programs, 8]}
    -> us against the release of the GEMM's wait. Attention programs with no keys stamp only their start (their
    rows are left 0 past it) and are left out."""
    gemm = layer["tma_gemm"].cpu().tolist()
    t0 = statistics.median(r[RELEASED] for r in gemm)
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    attn = [r for r in layer["attention"].cpu().tolist() if r[END] > 0]
    out = dict(attention=len(attn), attention_sms=len({r[SM] for r in attn}),
               attention_span=[us(min(r[START] for r in attn)), us(statistics.median(r[RELEASED] for r in attn)),
                               us(statistics.median(r[END] for r in attn)), us(max(r[END] for r in attn))])
    if "merge" in layer:
        merge = [r for r in layer["merge"].cpu().tolist() if r[END] > 0]
        out["merge_span"] = [us(min(r[START] for r in merge)), us(max(r[END] for r in merge))]
    last_end: dict[int, int] = {}
    for r in attn:
        last_end[r[SM]] = max(last_end.get(r[SM], 0), r[END])
    out["beside"] = sum(r[START] < last_end.get(r[SM], 0) for r in gemm)
    out["gemm_span"] = [us(_pct([r[START] for r in gemm], 0.5)), us(max(r[END] for r in gemm))]
    return out


def layers(launches: list[tuple[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The launches in order, cut into layers at each attention launch; only layers that ran a TMA GEMM whose
    stamps were written (a buffer of a capture the runner threw away stays 0)."""
    out: list[dict[str, torch.Tensor]] = []
    for name, buf in launches:
        if name == "attention":
            out.append({})
        if out:
            out[-1].setdefault(name, buf)  # (the first TMA GEMM after the attention: o)
    return [lay for lay in out if "tma_gemm" in lay and int(lay["tma_gemm"][:, RELEASED].min()) > 0]


TIMELINE_HEADER = (f"{'layer':<8}{'attn':>5}{'SMs':>5}   {'attention: start  wait   end p50  end max':<40}   "
                   f"{'merge: start  end':<18}   {'gemm: start p50  end max':<25}{'beside':>7}")


def format_timeline(label: str, t: dict) -> str:
    f = lambda xs: " ".join(f"{x:7.1f}" for x in xs)  # noqa: E731
    merge = f(t["merge_span"]) if "merge_span" in t else f"{'-':>7} {'-':>7}"
    return (f"{label:<8}{t['attention']:>5.0f}{t['attention_sms']:>5.0f}   {f(t['attention_span']):<40}   "
            f"{merge:<18}   {f(t['gemm_span']):<25}{t['beside']:>7.0f}")


class TracedLaunches:
    """While installed, the TMA GEMM (fp8_tma_linear) and the paged attention with its split merge, launched
    during a CUDA graph capture, stamp their programs' clocks into buffers of their own (cut from one zeroed arena
    allocated before the capture: kernels/triton/trace.py Trace), appended to `launches` as (name, buffer) in
    launch order; each replay of the graph rewrites them."""

    def __init__(self, device: str = "cuda"):
        from tandem.kernels.triton import attention, fp8_tma
        from tandem.kernels.triton.trace import Trace
        self.launches = Trace(1 << 18, torch.device(device))  # (16 MB; a capture of the 30B's step takes ~50K rows)
        self._undo = []
        for module, name in ((fp8_tma, "fp8_tma_linear"), (attention, "_paged_attention")):
            plain = getattr(module, name)

            def traced(*args, _plain=plain, **kwargs):
                if torch.cuda.is_current_stream_capturing():
                    kwargs["trace"] = self.launches
                return _plain(*args, **kwargs)

            setattr(module, name, traced)
            self._undo.append((module, name, plain))

    def restore(self) -> None:
        for module, name, plain in self._undo:
            setattr(module, name, plain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode_step_args(ap, fp8="block", kv_cache_dtype="fp8")
    ap.add_argument("--replays", type=int, default=20, help="graph replays before the stamps are read (the last's)")
    ap.add_argument("--layers", type=int, default=4, help="layers printed one by one before the mean")
    kernel_flags(ap)
    from benchmarks.ab_decode import plans_flag, plans_from_flag
    plans_flag(ap)
    args = ap.parse_args()
    from benchmarks.profile_decode import decoding_engine
    with plans_from_flag(args):  # (the graph is captured again inside: the plans must still be in)
        trace(args, decoding_engine(args, 64))


def trace(args: argparse.Namespace, llm) -> None:
    """Both tables of args' step, the engine llm's graph captured again with the launches traced."""
    from benchmarks.profile_decode import recapture
    runner = llm.engine.runner
    hook = TracedLaunches()
    try:
        recapture(runner, args.batch, with_logits=True)
    finally:
        hook.restore()
    if not any(name == "tma_gemm" for name, _ in hook.launches):
        raise SystemExit("no fp8_tma_linear launch in the captured step: this model, batch and these flags do not "
                         "run the o projection on the TMA GEMM (kernels.fp8._tma_gemm)")
    graph = runner.graphs.graphs[args.batch][0]
    for _ in range(args.replays):
        graph.replay()
    torch.cuda.synchronize()
    lays = layers(hook.launches)
    summaries = [summarize(lay["tma_gemm"]) for lay in lays]
    print(f"{torch.cuda.get_device_name()}: {args.model} b={args.batch} ctx={args.context}, {len(summaries)} "
          f"layers with a TMA GEMM; us against the release of each GEMM's PDL wait")
    print(HEADER)
    for i, s in enumerate(summaries[:args.layers]):
        print(format_row(f"#{i}", s))
    print(format_row("mean", mean_summary(summaries)))
    timelines = [layer_timeline(lay) for lay in lays]
    print(TIMELINE_HEADER)
    for i, t in enumerate(timelines[:args.layers]):
        print(format_timeline(f"#{i}", t))
    print(format_timeline("mean", mean_summary(timelines)))


if __name__ == "__main__":
    main()

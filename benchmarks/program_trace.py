"""When each program of the FP8 o projection's TMA GEMM (kernels/triton/fp8_tma.py) runs inside the decode step's
CUDA graph: per program the GPU clock (%globaltimer, ns) at its start, at the release of its PDL wait (the kernels
ahead done), when all of its weight had arrived in shared memory, and at its end, and its SM (TRACE).

Why: at batch 1 that GEMM is let in while the attention runs, so its weight can stream before the merge ends, yet
on an H100 it stays exposed ~11 us after the merge for 5.6 us of weight bytes, and takes 9.7 us alone
(benchmarks/RESULTS.md, fortieth session). The stamps tell the causes apart, relative to the release of the wait:
programs that only start near it (no room beside the attention), weight that arrives well after its early
request (slow reads), or an end well after the weight (the tail: the split's ticket and the epilogue).

  python -m benchmarks.program_trace --model llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 1

Per launch (one a decoder layer), us against the wait's release (the median program's): programs, SMs, the most
programs an SM held; start, weight in and end as percentiles over the programs; how many programs started 1 us or
more before the release. "Weight in" is when a program, past its wait and its staging of x, found all of its
weight tiles landed: never before the release, and a few tenths of a us past it where the weight was already
there. Then the mean over the layers. %globaltimer's update interval is the GPU's (up to 1 us on some), fine for
gaps of several us.
"""
import argparse
import statistics

import torch

from benchmarks.roofline import decode_step_args, kernel_flags

START, RELEASED, WEIGHT_IN, END, SM = range(5)  # the columns of a program's row (kernels/triton/fp8_tma.py _stamp)


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


class TracedTMAGemm:
    """While installed, every fp8_tma_linear launched during a CUDA graph capture stamps its programs' clocks into
    a buffer of its own (`buffers`, in launch order), which each replay of the graph rewrites."""

    def __init__(self):
        from tandem.kernels.triton import fp8_tma
        self.module, self.plain, self.buffers = fp8_tma, fp8_tma.fp8_tma_linear, []

        def traced(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                kwargs["trace"] = self.buffers
            return self.plain(*args, **kwargs)

        fp8_tma.fp8_tma_linear = traced

    def restore(self) -> None:
        self.module.fp8_tma_linear = self.plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode_step_args(ap, fp8="block", kv_cache_dtype="fp8")
    ap.add_argument("--replays", type=int, default=20, help="graph replays before the stamps are read (the last's)")
    ap.add_argument("--layers", type=int, default=4, help="layers printed one by one before the mean")
    kernel_flags(ap)
    args = ap.parse_args()
    from benchmarks.profile_decode import decoding_engine, recapture

    llm = decoding_engine(args, 64)
    runner = llm.engine.runner
    hook = TracedTMAGemm()
    try:
        recapture(runner, args.batch, with_logits=True)
    finally:
        hook.restore()
    if not hook.buffers:
        raise SystemExit("no fp8_tma_linear launch in the captured step: this model, batch and these flags do not "
                         "run the o projection on the TMA GEMM (kernels.fp8._tma_gemm)")
    for b in hook.buffers:  # (allocated empty in the capture, so that no memset sits between two launches)
        b.zero_()
    graph = runner.graphs.graphs[args.batch][0]
    for _ in range(args.replays):
        graph.replay()
    torch.cuda.synchronize()
    # (a buffer of a capture the runner threw away is never written: its programs' stamps stay 0)
    summaries = [summarize(b) for b in hook.buffers if int(b[:, RELEASED].min()) > 0]
    print(f"{torch.cuda.get_device_name()}: {args.model} b={args.batch} ctx={args.context}, {len(summaries)} "
          f"fp8_tma_linear launches a step; us against the release of each launch's PDL wait")
    print(HEADER)
    for i, s in enumerate(summaries[:args.layers]):
        print(format_row(f"#{i}", s))
    print(format_row("mean", mean_summary(summaries)))


if __name__ == "__main__":
    main()

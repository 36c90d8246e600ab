"""When each program of the decode layer's attention, its split merge, the FP8 o projection's TMA GEMM and the
ring GEMMs and experts (kernels/triton/fp8_tma.py) runs inside the decode step's CUDA graph: per program the GPU
clock (%globaltimer, ns) at its start, at the release of its PDL wait (the kernels ahead done), (the GEMMs') when
its weight had arrived in shared memory (the TMA GEMM: all of it; a ring: its first stage), and at its end, and
its SM (TRACE; kernels/triton/trace.py). Launches of other kernels (norms, the router, the LM head) are not
stamped.

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

Second table, per layer, every traced launch in order on the same clock (the release of the layer's o GEMM):
its programs that ran to the end (attention programs without keys return early and are left out), their SMs,
how many started 1 us or more before their own release; the first start, the median release, (the rings') the
median time its first stages were requested ("issued": before the release, except for w13, which ranks the router
logits after its wait first), weight in, the median end and the last end; and "exposed", its last end less the
last end of the traced launch before it (an untraced launch between counts in the next one). A layer runs from its
attention to the next layer's qkv ring. %globaltimer's update interval is the GPU's (up to 1 us on some), fine for
gaps of several us.
"""
import argparse
import statistics

import torch

from benchmarks.roofline import decode_step_args, kernel_flags

from tandem.kernels.triton.trace import END, ISSUED, RELEASED, SM, START, WEIGHT_IN


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


def _launch(name: str, stamps: torch.Tensor) -> dict | None:
    """One launch's programs that ran to their end stamp (those returning early, attention programs without keys,
    and every program of a launch the replays did not run, leave it 0), ns, and its stamps as they are; None where
    there are none."""
    rows = [r for r in stamps.cpu().tolist() if r[END] > 0]
    if not rows:
        return None
    released = statistics.median(r[RELEASED] for r in rows)
    weight = [r[WEIGHT_IN] for r in rows if r[WEIGHT_IN] > 0]
    issued = [r[ISSUED] for r in rows if r[ISSUED] > 0]
    return dict(name=name, stamps=stamps, programs=len(rows), sms=len({r[SM] for r in rows}),
                early=sum(r[START] <= released - 1000 for r in rows), start=min(r[START] for r in rows),
                released=released, issued=statistics.median(issued) if issued else None,
                weight_in=statistics.median(weight) if weight else None,
                end=statistics.median(r[END] for r in rows), last=max(r[END] for r in rows))


def layers(launches: list[tuple[str, torch.Tensor]]) -> list[list[dict]]:
    """The launches in order (kernels/triton/trace.py: the attention, its merge, the TMA GEMM, the rings, the
    experts' w13 and w2) cut into layers at each attention launch: per launch its programs (_launch) and "exposed",
    its last end less the last end of the launch before it in the step, us. Only layers with a TMA GEMM (o), and
    on the clock of its wait's release (0 us): start, released, weight in, end and last in us."""
    ran = []
    for name, buf in launches:
        launch = _launch(name, buf)
        if launch is not None:
            launch["exposed"] = (launch["last"] - ran[-1]["last"]) / 1e3 if ran else None
            ran.append(launch)
    kept = []
    for lay in _cut(ran):
        gemm = next((la for la in lay if la["name"] == "tma_gemm"), None)
        if gemm is None:
            continue
        t0 = gemm["released"]
        for la in lay:
            for k in ("start", "released", "end", "last"):
                la[k] = (la[k] - t0) / 1e3
            for k in ("issued", "weight_in"):
                la[k] = (la[k] - t0) / 1e3 if la[k] is not None else None
        kept.append(lay)
    return kept


def _cut(launches: list[dict]) -> list[list[dict]]:
    """Launches in order cut into layers, one starting at each attention launch (those before the first:
    dropped)."""
    out: list[list[dict]] = []
    for la in launches:
        if la["name"] == "attention":
            out.append([])
        if out:
            out[-1].append(la)
    return out


def mean_layer(lays: list[list[dict]]) -> list[dict]:
    """The layers whose launches are named as the first's, averaged launch by launch (a figure absent anywhere:
    None)."""
    names = [la["name"] for la in lays[0]]
    same = [lay for lay in lays if [la["name"] for la in lay] == names]
    out = []
    for i, name in enumerate(names):
        row = dict(name=name)
        for k in ("programs", "sms", "early", "start", "released", "issued", "weight_in", "end", "last", "exposed"):
            vals = [lay[i][k] for lay in same]
            row[k] = statistics.fmean(vals) if all(v is not None for v in vals) else None
        out.append(row)
    return out


CHAIN_HEADER = (f"{'layer':<6}{'launch':<18}{'progs':>6}{'SMs':>5}{'early':>6}{'start':>8}{'release':>8}"
                f"{'issued':>7}{'w in':>7}{'end':>7}{'last':>7}{'exposed':>8}")


def format_launch(label: str, la: dict) -> str:
    f = lambda v, w=7: f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    return (f"{label:<6}{la['name']:<18}{la['programs']:>6.0f}{la['sms']:>5.0f}{la['early']:>6.0f}{f(la['start'], 8)}"
            f"{f(la['released'], 8)}{f(la['issued'])}{f(la['weight_in'])}{f(la['end'])}{f(la['last'])}"
            f"{f(la['exposed'], 8)}")


class TracedLaunches:
    """While installed, the TMA GEMM (fp8_tma_linear), the ring GEMMs and experts (two launches, or one: "moe"), and
    the paged attention with its split merge, launched during a CUDA graph capture, stamp their programs' clocks into
    buffers of their own (cut from one zeroed arena allocated before the capture: kernels/triton/trace.py Trace),
    appended to `launches` as (name, buffer) in launch order; each replay of the graph rewrites them."""

    def __init__(self, device: str = "cuda"):
        from tandem.kernels.triton import attention, fp8_tma, fp8_tma_moe
        from tandem.kernels.triton.trace import Trace
        self.launches = Trace(1 << 18, torch.device(device))  # (16 MB; take() says so where a capture outgrows it)
        self._undo = []
        for module, name in ((fp8_tma, "fp8_tma_linear"), (fp8_tma, "fp8_tma_ring_linear"),
                             (fp8_tma, "fp8_tma_ring_experts"), (fp8_tma_moe, "fp8_tma_fused_experts"),
                             (attention, "_paged_attention")):
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
    summaries = [summarize(next(la["stamps"] for la in lay if la["name"] == "tma_gemm")) for lay in lays]
    print(f"{torch.cuda.get_device_name()}: {args.model} b={args.batch} ctx={args.context}, {len(summaries)} "
          f"layers with a TMA GEMM; us against the release of each GEMM's PDL wait")
    print(HEADER)
    for i, s in enumerate(summaries[:args.layers]):
        print(format_row(f"#{i}", s))
    print(format_row("mean", mean_summary(summaries)))
    print(CHAIN_HEADER)
    for i, lay in enumerate(lays[:args.layers]):
        for la in lay:
            print(format_launch(f"#{i}", la))
    for la in mean_layer(lays):
        print(format_launch("mean", la))


if __name__ == "__main__":
    main()

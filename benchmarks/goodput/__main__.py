"""`python -m benchmarks.goodput`: goodput of one or more deployments under one workload.

    python -m benchmarks.goodput --topology colloc:1 --topology pd:1p1d:write:ipc \\
        --server-args "--model /models/llama --load-format dummy" \\
        --rates 2,4,6,8,10 --num-prompts 120 --random-input-len 2000 --random-output-len 200 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 50 --fresh-server-per-rate --out-dir benchmarks/out/goodput

Topology specs: see benchmarks/goodput/topology.py (or --help). Workload flags are those of
benchmarks.serve. Writes OUT_DIR/goodput.json, attainment.png and scatter.png.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from pathlib import Path

from benchmarks.goodput.deployment import LaunchOptions
from benchmarks.goodput.plots import attainment_plot, scatter_plot
from benchmarks.goodput.slo import DEFINITIONS, SLO
from benchmarks.goodput.sweep import SweepConfig, run_sweep
from benchmarks.goodput.topology import Topology
from benchmarks.goodput.topology import __doc__ as TOPOLOGY_DOC
from benchmarks.serve import BenchmarkConfig, add_workload_args

logger = logging.getLogger("benchmarks.goodput")


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates, got {text!r}") from e
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text!r}")
    return rates


def _topology(text: str) -> Topology:
    try:
        return Topology.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.splitlines()[0],
                                epilog=TOPOLOGY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("deployment")
    g.add_argument("--topology", type=_topology, action="append", default=[],
                   help="colloc:N[:direct] or pd:XpYd[:write|read][:tcp|ipc|mori], then :gpus=G :name=X; repeatable")
    g.add_argument("--topology-file", default=None, help="JSON list of topologies (fields of Topology)")
    g.add_argument("--server-args", default="", help="`server` flags for every instance, one string")
    g.add_argument("--gpus", default="auto",
                   help="GPU ids handed out to instances in order (e.g. 0,1,2,3); auto: all visible; none: CPU")
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a tree may take to be ready")
    w = p.add_argument_group("workload (as benchmarks.serve)")
    add_workload_args(w)
    w.add_argument("--respect-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore it, every output is max_tokens long)")
    p.set_defaults(ignore_eos=True)
    s = p.add_argument_group("sweep")
    s.add_argument("--rates", type=_rates, required=True, help="request rates to sweep, e.g. 2,4,6,8")
    s.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT SLO (ms)")
    s.add_argument("--slo-tpot-ms", type=float, required=True, help="TPOT SLO (ms); strict variant: every ITL")
    s.add_argument("--target", type=float, default=90.0, help="attainment (%%) a rate must reach")
    s.add_argument("--definition", choices=DEFINITIONS, default="vllm",
                   help="attainment that defines goodput: vllm (TTFT and TPOT) or strict (TTFT and every ITL)")
    s.add_argument("--bisect-steps", type=int, default=2, help="extra rates measured between the bracket")
    s.add_argument("--min-rate-step", type=float, default=0.25, help="stop bisecting below this (req/s)")
    s.add_argument("--fresh-server-per-rate", action="store_true", help="restart the tree for every rate")
    s.add_argument("--warmup-prompts", type=int, default=0, help="unmeasured requests after each start")
    s.add_argument("--duration", type=float, default=0.0,
                   help="seconds of arrivals at each rate: send max(--num-prompts, rate x this) requests")
    s.add_argument("--stop-at-miss", action="store_true",
                   help="measure no rate above a topology's first that misses the target (then bisect below it)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=None, help="default benchmarks/out/goodput-DATE")
    o.add_argument("--scatter-rate", type=float, default=None,
                   help="rate of the TTFT/ITL scatter (nearest measured; default: the highest swept)")
    o.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    return p


def _gpus(text: str) -> tuple[str, ...]:
    if text == "none":
        return ()
    if text != "auto":
        return tuple(x for x in text.split(",") if x)
    import torch  # only to count GPUs

    return tuple(str(i) for i in range(torch.cuda.device_count()))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
    parser = build_parser()
    args = parser.parse_args(argv)
    topologies = list(args.topology) + (Topology.from_file(args.topology_file) if args.topology_file else [])
    if not topologies:
        parser.error("give at least one --topology or a --topology-file")
    if not 0 < args.target <= 100:
        parser.error("--target is a percentage in (0, 100]")
    workload = BenchmarkConfig(**{f.name: getattr(args, f.name) for f in fields(BenchmarkConfig)
                                  if hasattr(args, f.name) and f.name not in ("model", "api_key")})
    sweep = SweepConfig(rates=args.rates, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms), target=args.target / 100,
                        definition=args.definition, bisect_steps=args.bisect_steps,
                        min_rate_step=args.min_rate_step, fresh_server_per_rate=args.fresh_server_per_rate,
                        warmup_prompts=args.warmup_prompts, stop_at_miss=args.stop_at_miss,
                        duration_s=args.duration)
    launch = LaunchOptions(server_args=tuple(shlex.split(args.server_args)), gpus=_gpus(args.gpus),
                           startup_timeout_s=args.startup_timeout)
    out_dir = Path(args.out_dir or f"benchmarks/out/goodput-{datetime.now():%Y%m%d-%H%M%S}")
    try:
        report = run_sweep(topologies, workload, sweep, launch, out_dir)
    except (RuntimeError, TimeoutError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from e
    for topo in report["topologies"]:
        g = topo["goodput"]
        print(f"{topo['name']:<32} goodput {g['rate']:8.3g} req/s{'+' if g['lower_bound'] else ' '}  "
              + "  ".join(f"{p['rate']:g}:{100 * p['attainment']:.0f}%" for p in topo["points"]))
    if not args.no_plot:
        attainment_plot(report, out_dir / "attainment.png")
        scatter_plot(report, out_dir, args.scatter_rate or max(args.rates), out_dir / "scatter.png")
    logger.info("wrote %s", out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

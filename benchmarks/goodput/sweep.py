"""One goodput sweep: for each topology, start its tree, run benchmarks.serve at each rate (and the
bisection's midpoints), stop it, and collect per-rate SLO attainment and the goodput.

Files under out_dir: goodput.json (the report, rewritten after each topology), and per topology
<name>/rate-<R>.json (benchmarks.serve's full result: summary and every request) and
<name>/logs/ (each process's log; one folder per rate with a fresh server per rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.goodput.deployment import Deployment, LaunchOptions
from benchmarks.goodput.slo import SLO, attainment, goodput_of, misses, search_goodput
from benchmarks.goodput.topology import Topology
from benchmarks.serve import BenchmarkConfig, BenchmarkResult, run_benchmark, save_result

logger = logging.getLogger(__name__)

REPORT_NAME = "goodput.json"
ATTAINMENT = {"vllm": "attainment", "strict": "attainment_strict"}  # definition -> its column of a rate's row


@dataclass(frozen=True)
class SweepConfig:
    rates: tuple[float, ...]
    slo: SLO
    target: float = 0.9  # attainment (0..1) a rate must reach to count toward goodput
    definition: str = "vllm"  # which attainment drives the goodput search: vllm (TPOT) or strict (every ITL)
    bisect_steps: int = 2
    min_rate_step: float = 0.25  # stop bisecting below this bracket half-width (req/s)
    fresh_server_per_rate: bool = False  # start the tree anew for every rate
    warmup_prompts: int = 0  # requests sent (all at once, not measured) after each start
    stop_at_miss: bool = False  # measure no rate above the first that misses the target
    duration_s: float = 0.0  # send at least rate x duration_s requests at each rate (arrivals last ~that long)


def point_row(rate: float, result: BenchmarkResult, slo: SLO, result_file: str, bisection: bool) -> dict[str, Any]:
    """One rate's line of the report: both attainments, recomputed from the per-request records."""
    s = result.summary
    keys = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")
    return {"rate": rate, "attainment": attainment(result.records, slo, "vllm"),
            "attainment_strict": attainment(result.records, slo, "strict"), "misses": misses(result.records, slo),
            **{k: s.get(k) for k in keys}, "result_file": result_file, "bisection": bisection}


def engine_phases_ms(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Mean engine phase (ms) of the requests finished between two Deployment.phase_totals
    snapshots, by role (instance names less their index: collocated, prefill, decode); phases no
    request reached are left out. On a PD decode, kv_transfer_wait + queue + prefill (its first step)
    is the engine's part of a request's first inter-token gap."""
    sums: dict[str, dict[str, list[float]]] = {}
    for name, phases in after.items():
        role = name.rstrip("0123456789")
        for phase, (total, count) in phases.items():
            total0, count0 = before.get(name, {}).get(phase, (0.0, 0.0))
            acc = sums.setdefault(role, {}).setdefault(phase, [0.0, 0.0])
            acc[0] += total - total0
            acc[1] += count - count0
    return {role: {phase: 1000 * total / count for phase, (total, count) in phases.items() if count > 0}
            for role, phases in sums.items()}


def prompts_at(num_prompts: int, rate: float, duration_s: float) -> int:
    """Requests to send at `rate`: num_prompts, or more so that arrivals span duration_s (a short
    burst at a high rate ends before queues build, and overstates what the rate sustains)."""
    return max(num_prompts, math.ceil(rate * duration_s))


async def _warm_up(workload: BenchmarkConfig, url: str, n: int) -> None:
    await run_benchmark(dataclasses.replace(workload, base_url=url, num_prompts=n, request_rate=math.inf,
                                            seed=workload.seed + 1, disable_tqdm=True))


def run_topology(topology: Topology, workload: BenchmarkConfig, sweep: SweepConfig, launch: LaunchOptions,
                 out_dir: Path) -> dict[str, Any]:
    """Sweep one topology; returns its part of the report."""
    topo_dir = out_dir / topology.name
    rows: dict[float, dict] = {}
    bar = tqdm(total=len(set(sweep.rates)) + sweep.bisect_steps, desc=topology.name, unit="rate", position=0)
    with contextlib.ExitStack() as shared:
        shared_url = shared_tree = None
        if not sweep.fresh_server_per_rate:
            bar.set_postfix_str("starting")
            shared_tree = Deployment(topology, launch, topo_dir / "logs")
            shared_url = shared.enter_context(shared_tree)
            if sweep.warmup_prompts:
                asyncio.run(_warm_up(workload, shared_url, sweep.warmup_prompts))

        def measure(rate: float) -> float:
            with contextlib.ExitStack() as fresh:
                url, tree = shared_url, shared_tree
                if url is None:
                    bar.set_postfix_str(f"starting for rate {rate:g}")
                    tree = Deployment(topology, launch, topo_dir / "logs" / f"rate-{rate:g}")
                    url = fresh.enter_context(tree)
                    if sweep.warmup_prompts:
                        asyncio.run(_warm_up(workload, url, sweep.warmup_prompts))
                bar.set_postfix_str(f"rate {rate:g}")
                config = dataclasses.replace(workload, base_url=url, request_rate=rate,
                                             num_prompts=prompts_at(workload.num_prompts, rate, sweep.duration_s),
                                             slos_ms=sweep.slo.metrics(sweep.definition))
                before = tree.phase_totals()
                result = asyncio.run(run_benchmark(config))
                phases = engine_phases_ms(before, tree.phase_totals())
            path = save_result(result, topo_dir, f"rate-{rate:g}.json")
            row = point_row(rate, result, sweep.slo, str(path.relative_to(out_dir)), bisection=rate not in sweep.rates)
            row["engine_phases_ms"] = phases
            rows[rate] = row
            bar.update(1)
            bar.set_postfix_str(f"rate {rate:g}: attainment {100 * row['attainment']:.1f}% "
                                f"(strict {100 * row['attainment_strict']:.1f}%)")
            return row[ATTAINMENT[sweep.definition]]

        search_goodput(measure, sweep.rates, sweep.target, sweep.bisect_steps, sweep.min_rate_step,
                       stop_at_miss=sweep.stop_at_miss)
    bar.close()
    return topology_report(topology.name, dataclasses.asdict(topology), [rows[r] for r in sorted(rows)],
                           sweep.target, sweep.definition)


def topology_report(name: str, topology: dict[str, Any], points: list[dict[str, Any]], target: float,
                    definition: str) -> dict[str, Any]:
    """A topology's part of the report: its rows (ascending rates), its goodput under
    `definition`, and under the other one as goodput_<other>."""
    other = "strict" if definition == "vllm" else "vllm"
    goodput = {d: goodput_of({p["rate"]: p[key] for p in points}, target).to_json() for d, key in ATTAINMENT.items()}
    return {"name": name, "topology": topology, "points": points, "goodput": goodput[definition],
            f"goodput_{other}": goodput[other]}


def run_sweep(topologies: list[Topology], workload: BenchmarkConfig, sweep: SweepConfig, launch: LaunchOptions,
              out_dir: Path) -> dict[str, Any]:
    """Every topology in turn; goodput.json is written after each one, so a later failure keeps
    the finished ones. Returns the report."""
    names = [t.name for t in topologies]
    if len(set(names)) != len(names):
        raise ValueError(f"topology names must differ (they name folders): {names}; set name=...")
    workload_json = dataclasses.asdict(workload)
    for k in ("base_url", "request_rate", "slos_ms"):
        workload_json.pop(k)
    report: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
        "workload": workload_json, "server_args": list(launch.server_args), "gpus": list(launch.gpus),
        "slo": {"ttft_ms": sweep.slo.ttft_ms, "tpot_ms": sweep.slo.tpot_ms}, "target": sweep.target,
        "definition": sweep.definition, "fresh_server_per_rate": sweep.fresh_server_per_rate,
        "warmup_prompts": sweep.warmup_prompts, "stop_at_miss": sweep.stop_at_miss, "duration_s": sweep.duration_s,
        "topologies": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    for topology in topologies:
        report["topologies"].append(run_topology(topology, workload, sweep, launch, out_dir))
        (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2))
        g = report["topologies"][-1]["goodput"]
        logger.info("%s: goodput %.3g req/s%s (target %.0f%%, %s)", topology.name, g["rate"],
                    " or more (every rate met the target)" if g["lower_bound"] else "", 100 * sweep.target,
                    sweep.definition)
    return report

"""Plots of a goodput report: SLO attainment vs request rate for every topology on one chart, and
per-request TTFT and inter-token latencies over time at one rate (where the misses are)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def attainment_plot(report: dict[str, Any], path: Path) -> Path:
    """Attainment (%) vs offered rate: solid = TTFT+TPOT (vLLM), dashed = TTFT+every ITL (strict);
    the target as a horizontal line, each topology's goodput as a dotted vertical line."""
    from matplotlib.figure import Figure  # lazy: slow to import

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for i, topo in enumerate(report["topologies"]):
        color = f"C{i}"
        rates = [p["rate"] for p in topo["points"]]
        ax.plot(rates, [100 * p["attainment"] for p in topo["points"]], "o-", color=color,
                label=f"{topo['name']} (goodput {topo['goodput']['rate']:.3g} req/s"
                      f"{'+' if topo['goodput']['lower_bound'] else ''})")
        ax.plot(rates, [100 * p["attainment_strict"] for p in topo["points"]], "x--", color=color, alpha=0.6,
                label=f"{topo['name']}, every ITL")
        if topo["goodput"]["rate"] > 0:
            ax.axvline(topo["goodput"]["rate"], color=color, linestyle=":", alpha=0.7)
    ax.axhline(100 * report["target"], color="gray", linestyle="-.", linewidth=1, label="target")
    slo = report["slo"]
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-2, 102),
           title=f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _ms(seconds: float | None) -> float:
    """Milliseconds for a log axis (a missing or zero value drawn at 1 us)."""
    return max((seconds or 0.0) * 1e3, 1e-3)


def nearest_point(topo: dict[str, Any], rate: float) -> dict[str, Any]:
    return min(topo["points"], key=lambda p: (abs(p["rate"] - rate), p["rate"]))


def scatter_plot(report: dict[str, Any], out_dir: Path, rate: float, path: Path) -> Path:
    """At the measured rate nearest `rate`, per topology: each request's TTFT (left) and its TPOT
    and largest inter-token gap (right) against the time it was sent; SLOs as lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax_ttft, ax_itl = fig.subplots(1, 2)
    for i, topo in enumerate(report["topologies"]):
        point = nearest_point(topo, rate)
        requests = [r for r in json.loads((out_dir / point["result_file"]).read_text())["requests"] if r["success"]]
        label = f"{topo['name']} @ {point['rate']:g} req/s"
        starts = [r["start_s"] for r in requests]
        ax_ttft.scatter(starts, [_ms(r["ttft_s"]) for r in requests], s=10, color=f"C{i}", label=label)
        ax_itl.scatter(starts, [_ms(r["tpot_s"]) for r in requests], s=10, color=f"C{i}",
                       label=f"{label}, TPOT")
        ax_itl.scatter(starts, [_ms(max(r["itl_s"], default=0.0)) for r in requests], s=10, marker="x",
                       color=f"C{i}", alpha=0.5, label=f"{label}, max ITL")
    slo = report["slo"]
    ax_ttft.axhline(slo["ttft_ms"], color="gray", linestyle="-.", linewidth=1, label="TTFT SLO")
    ax_itl.axhline(slo["tpot_ms"], color="gray", linestyle="-.", linewidth=1, label="TPOT/ITL SLO")
    ax_ttft.set(xlabel="request sent at (s)", ylabel="TTFT (ms)", yscale="log", title="Time to first token")
    ax_itl.set(xlabel="request sent at (s)", ylabel="ms", yscale="log", title="TPOT and largest inter-token gap")
    for ax in (ax_ttft, ax_itl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path

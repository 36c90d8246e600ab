"""Merge goodput reports of one workload into one: `python -m benchmarks.goodput.merge --out DIR
RUN_DIR...`. Time-boxed runs (scripts/device/goodput_2gpu.sh) measure one topology per run, and a
later run may add rates to a topology; the merged report has every topology once, with the union
of its measured rates (a rate measured twice keeps the later run's), its goodput recomputed under
both definitions, and the attainment chart of them all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.goodput.sweep import REPORT_NAME, topology_report

_SAME = ("workload", "slo", "target", "definition", "server_args")


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Reports in run order -> one report (the first's settings; the others must share them)."""
    if not reports:
        raise ValueError("no reports to merge")
    first = reports[0]
    for r in reports[1:]:
        for key in _SAME:
            if r.get(key) != first.get(key):
                raise ValueError(f"reports differ in {key!r}: {first.get(key)!r} vs {r.get(key)!r}")
    topologies: dict[str, dict[str, Any]] = {}
    for r in reports:
        for t in r["topologies"]:
            merged = topologies.setdefault(t["name"], {"name": t["name"], "topology": t["topology"], "points": {}})
            merged["points"].update({p["rate"]: p for p in t["points"]})
    out = [topology_report(t["name"], t["topology"], [t["points"][rate] for rate in sorted(t["points"])],
                           first["target"], first["definition"]) for t in topologies.values()]
    return {**{k: v for k, v in first.items() if k != "topologies"}, "merged_from": len(reports), "topologies": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path,
                    help="run folders (each with a goodput.json) or report files, in run order")
    ap.add_argument("--out", type=Path, required=True, help="folder for the merged goodput.json and attainment.png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    report = merge_reports([json.loads((d / REPORT_NAME if d.is_dir() else d).read_text()) for d in args.runs])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / REPORT_NAME).write_text(json.dumps(report, indent=2))
    for t in report["topologies"]:
        other = next(k for k in t if k.startswith("goodput_"))
        print(f"{t['name']:<28} goodput {t['goodput']['rate']:g}{'+' if t['goodput']['lower_bound'] else ''} "
              f"req/s ({report['definition']}), {t[other]['rate']:g}{'+' if t[other]['lower_bound'] else ''} "
              f"({other[len('goodput_'):]})  " + "  ".join(f"{p['rate']:g}:{100 * p['attainment']:.0f}%"
                                                          for p in t["points"]))
        missed = next((p for p in t["points"] if p["attainment"] < report["target"] and p.get("misses")), None)
        if missed:
            m = missed["misses"]
            print(f"{'':<28} at {missed['rate']:g} req/s: failed {100 * m['failed']:.0f}%, TTFT over "
                  f"{100 * m['ttft']:.0f}%, TPOT over {100 * m['tpot']:.0f}%, a gap over {100 * m['itl']:.0f}%; "
                  f"first gap p50 {m['first_gap_p50_ms'] or 0:.0f} ms, largest later gap p50 "
                  f"{m['max_later_gap_p50_ms'] or 0:.0f} ms")
            phases = missed.get("engine_phases_ms", {})  # (reports since 2026-11-28's eleventh session)
            if phases:
                print(f"{'':<28} engine phases there, mean ms: " + "; ".join(
                    f"{role} " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(ph.items()))
                    for role, ph in sorted(phases.items())))
    if not args.no_plot:
        from benchmarks.goodput.plots import attainment_plot
        attainment_plot(report, args.out / "attainment.png")


if __name__ == "__main__":
    main()

"""benchmarks.goodput end to end: the flow and the numbers' plumbing, never timing.

Reference: the attainment each rate reports is recomputed here from the per-request records
saved for that rate (TTFT, TPOT, every ITL), and the report's structure from the flags given.
1. a fake streaming server in place of the process tree (fast): fresh server per rate, bisection.
2. the CPU miniature: real `server` trees (default model, tcp): 1 collocated vs 1P+1D (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.goodput.sweep as sweep_module
from benchmarks.goodput.__main__ import main
from benchmarks.goodput.slo import SLO, attainment
from benchmarks.serve import RequestRecord
from tests.benchmarks.test_serve import fake_server  # noqa: F401 (fixture)


def _records(path: Path) -> list[RequestRecord]:
    return [RequestRecord(**{k: v for k, v in r.items() if k != "tpot_s"})
            for r in json.loads(path.read_text())["requests"]]


def check_report(out_dir: Path, names: list[str], num_prompts: int) -> dict:
    """Files written, and every reported attainment equal to its recomputation from the records."""
    report = json.loads((out_dir / "goodput.json").read_text())
    assert [t["name"] for t in report["topologies"]] == names
    slo = SLO(report["slo"]["ttft_ms"], report["slo"]["tpot_ms"])
    for topo in report["topologies"]:
        rates = [p["rate"] for p in topo["points"]]
        assert rates == sorted(rates)
        for p in topo["points"]:
            records = _records(out_dir / p["result_file"])
            assert len(records) == num_prompts
            assert p["attainment"] == pytest.approx(attainment(records, slo, "vllm"))
            assert p["attainment_strict"] == pytest.approx(attainment(records, slo, "strict"))
            assert p["attainment_strict"] <= p["attainment"]
        passing = [p["rate"] for p in topo["points"] if p["attainment"] >= report["target"]]
        assert topo["goodput"]["rate"] == (max(passing) if passing else 0.0)
    for png in ("attainment.png", "scatter.png"):
        assert (out_dir / png).stat().st_size > 1000
    return report


class FakeDeployment:
    """Stands in for the process tree: every start hands out the fake server's URL."""

    starts: list[str] = []
    url = ""

    def __init__(self, topology, options, log_dir):
        self.topology = topology

    def __enter__(self) -> str:
        FakeDeployment.starts.append(self.topology.name)
        return FakeDeployment.url

    def __exit__(self, *exc) -> None:
        pass

    def phase_totals(self) -> dict:
        return {}  # the fake server runs no engine


def test_fresh_server_per_rate_and_bisection(fake_server, monkeypatch, tmp_path):  # noqa: F811
    FakeDeployment.starts, FakeDeployment.url = [], f"{fake_server}/ok"
    monkeypatch.setattr(sweep_module, "Deployment", FakeDeployment)
    # The fake server's first token takes 50 ms: a 1 ms TTFT SLO fails every request, so the
    # search bisects below the lowest rate: 8, 16, then 4, then 2 (high rates: the requests are
    # paced in real time, and at 0.5/s three of them take seconds for the same flow).
    argv = ["--topology", "colloc:1", "--topology", "pd:1p1d", "--gpus", "none", "--rates", "8,16",
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3", "--vocab-size", "1000",
            "--slo-ttft-ms", "1", "--slo-tpot-ms", "1000", "--bisect-steps", "2", "--fresh-server-per-rate",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    assert FakeDeployment.starts == ["colloc1"] * 4 + ["pd1p1d-write-tcp"] * 4
    report = check_report(tmp_path, ["colloc1", "pd1p1d-write-tcp"], 3)
    for topo in report["topologies"]:
        assert [p["rate"] for p in topo["points"]] == [2.0, 4.0, 8.0, 16.0]
        assert [p["bisection"] for p in topo["points"]] == [True, True, False, False]
        assert all(p["attainment"] == 0.0 for p in topo["points"])
        assert topo["goodput"] == {"rate": 0.0, "bracket": [None, 2.0], "lower_bound": False}
    assert report["fresh_server_per_rate"] and report["workload"]["ignore_eos"]


def test_a_generous_slo_stops_without_bisection(fake_server, monkeypatch, tmp_path):  # noqa: F811
    FakeDeployment.starts, FakeDeployment.url = [], f"{fake_server}/ok"
    monkeypatch.setattr(sweep_module, "Deployment", FakeDeployment)
    argv = ["--topology", "colloc:1:direct", "--gpus", "none", "--rates", "1,3", "--num-prompts", "2",
            "--random-input-len", "8", "--random-output-len", "3", "--vocab-size", "1000", "--slo-ttft-ms", "10000",
            "--slo-tpot-ms", "10000", "--out-dir", str(tmp_path), "--scatter-rate", "1"]
    assert main(argv) == 0
    assert FakeDeployment.starts == ["colloc1-direct"]  # one tree for the whole sweep
    topo = check_report(tmp_path, ["colloc1-direct"], 2)["topologies"][0]
    assert [p["attainment"] for p in topo["points"]] == [1.0, 1.0]
    assert topo["goodput"] == {"rate": 3.0, "bracket": [3.0, None], "lower_bound": True}


@pytest.mark.slow
def test_cpu_miniature_collocated_vs_1p1d(tmp_path):
    """Real trees: router + 1 collocated instance, router + 1 prefill + 1 decode (write mode, tcp),
    default model; two tiny rates and one bisection step; every process stopped at the end."""
    argv = ["--topology", "colloc:1", "--topology", "pd:1p1d:write:tcp", "--gpus", "none",
            "--server-args", "--device cpu --max-model-len 256 --num-gpu-blocks-override 128 --max-num-seqs 8",
            "--rates", "1,2", "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
            "--slo-ttft-ms", "2000", "--slo-tpot-ms", "300", "--bisect-steps", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    report = check_report(tmp_path, ["colloc1", "pd1p1d-write-tcp"], 4)
    for topo in report["topologies"]:
        assert {1.0, 2.0} <= {p["rate"] for p in topo["points"]} and len(topo["points"]) <= 3
        for p in topo["points"]:
            assert p["completed"] == 4 and p["failed"] == 0
            # the engines' phases over the rate's requests (the instances' /metrics, before and after)
            phases = p["engine_phases_ms"]
            if topo["name"] == "colloc1":
                assert set(phases) == {"collocated"} and {"queue", "prefill", "decode"} <= set(phases["collocated"])
            else:
                assert set(phases) == {"prefill", "decode"} and "kv_transfer_wait" in phases["decode"]
                assert "kv_transfer_wait" not in phases["prefill"] and phases["prefill"]["prefill"] > 0
    logs = {p.name for p in (tmp_path / "pd1p1d-write-tcp" / "logs").iterdir()}
    assert logs == {"router.log", "prefill0.log", "decode0.log"}
    for log in (tmp_path / "colloc1" / "logs" / "collocated0.log", tmp_path / "pd1p1d-write-tcp" / "logs" /
                "decode0.log"):
        assert "SIGTERM received; stopping" in log.read_text()  # stopped cleanly, not killed

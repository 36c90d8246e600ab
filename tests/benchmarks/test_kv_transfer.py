"""benchmarks.kv_transfer runs against the connector's current interfaces (per-rank worker side,
RankPair) on CPU over tcp: a figure per block count, each from a timed move of that many blocks.
Reference: the block size of the benchmark's layout (8B shape, bf16: 2 MiB)."""
import json
import subprocess
import sys


def test_kv_transfer_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, "-m", "benchmarks.kv_transfer", "--transport", "tcp", "--src-device", "cpu",
                    "--dst-device", "cpu", "--blocks", "2", "4", "--repeats", "1", "--out", str(out)],
                   check=True, timeout=300)
    result = json.loads(out.read_text())
    assert [r["blocks"] for r in result["rows"]] == [2, 4]
    assert [r["mib"] for r in result["rows"]] == [4.0, 8.0]
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in result["rows"]) and result["ceiling_gbps"] > 0

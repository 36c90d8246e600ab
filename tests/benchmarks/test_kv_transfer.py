"""benchmarks.kv_transfer runs against the connector's current interfaces (per-rank worker side,
RankPair) on CPU over tcp: a figure per block count, each from a timed move of that many blocks.
Reference: the block size of the benchmark's layout (8B shape, bf16: 2 MiB), and the pattern each
side's cache starts with: the moved blocks must hold the source's (the benchmark exits non-zero
otherwise, and a transport that drops the data is caught here)."""
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


def test_landed_catches_a_wrong_block_layer_or_side():
    import torch

    from benchmarks.kv_transfer import DESTINATION, SOURCE, landed, pattern
    src, dst = pattern(range(6), "cpu", SOURCE), pattern(range(6), "cpu", DESTINATION)
    assert (src != dst).all()  # the sides differ everywhere: an untouched block never passes
    dst[:, :, [5, 4]] = src[:, :, [1, 2]]
    assert landed(dst, [5, 4], [1, 2], SOURCE) is None
    assert "differ" in landed(dst, [5, 4], [2, 1], SOURCE)  # blocks swapped
    assert "differ" in landed(dst, [3], [3], SOURCE)  # never moved
    shifted = dst.clone()
    shifted[:, 3:5, 5] = dst[:, 2:4, 5]  # one block's layers off by one
    assert "differ" in landed(shifted, [5], [1], SOURCE)
    heads = dst.clone()
    heads[..., 0, :] = dst[..., 1, :]
    assert "differ" in landed(heads, [5], [1], SOURCE)
    assert torch.equal(pattern([7], "cpu", 0), pattern(range(8), "cpu", 0)[:, :, 7:])

"""benchmarks.goodput without servers: SLO attainment, bracket and bisection, topology specs.

Reference: values computed by hand in the comments; for the search, a synthetic attainment
curve whose goodput is known."""

from __future__ import annotations

import json

import pytest

from benchmarks.goodput.deployment import instance_argv, instance_gpus, LaunchOptions
from benchmarks.goodput.slo import SLO, attainment, bracket, goodput_of, search_goodput
from benchmarks.goodput.topology import Topology
from benchmarks.serve import RequestRecord


def _record(ttft_ms: float, itls_ms: list[float], success: bool = True) -> RequestRecord:
    ttft, itls = ttft_ms / 1e3, [g / 1e3 for g in itls_ms]
    return RequestRecord(index=0, prompt_len=8, max_tokens=len(itls) + 1, ttft_s=ttft, e2el_s=ttft + sum(itls),
                         itl_s=itls, output_tokens=len(itls) + 1, success=success)


SLO_200_20 = SLO(ttft_ms=200, tpot_ms=20)
RECORDS = [
    _record(100, [10, 10, 10]),  # TPOT 10, max ITL 10: meets both
    _record(100, [5, 40, 5]),  # TPOT 16.7 meets; one gap of 40 fails the strict variant
    _record(300, [1, 1]),  # TTFT over: fails both
    _record(150, [30, 30]),  # TPOT 30: fails both
    _record(50, []),  # one token: no TPOT, no gap: meets both
    _record(10, [1], success=False),  # failed: fails both, still counted
]


def test_attainment_hand_computed():
    assert attainment(RECORDS, SLO_200_20, "vllm") == pytest.approx(3 / 6)
    assert attainment(RECORDS, SLO_200_20, "strict") == pytest.approx(2 / 6)
    assert attainment([], SLO_200_20) == 0.0
    assert attainment(RECORDS, SLO(ttft_ms=160, tpot_ms=100)) == pytest.approx(4 / 6)  # only r2 and r5 miss
    with pytest.raises(ValueError):
        SLO_200_20.metrics("p99")


@pytest.mark.parametrize("points,expected", [
    ({1: 1.0, 2: 0.95, 4: 0.5, 8: 0.0}, (2, 4)),
    ({1: 0.5, 2: 0.95, 4: 0.8, 6: 0.92, 8: 0.1}, (6, 8)),  # not monotone: the highest passing rate
    ({2: 0.1, 4: 0.0}, (None, 2)),
    ({2: 0.9, 4: 0.91}, (4, None)),  # the target itself passes
])
def test_bracket(points, expected):
    assert bracket(points, 0.9) == expected


def test_search_bisects_to_the_known_goodput():
    measured = []

    def curve(rate: float) -> float:  # goodput 5.3 req/s
        measured.append(rate)
        return 1.0 if rate <= 5.3 else 0.2

    goodput, points = search_goodput(curve, [8, 2, 4, 6], target=0.9, bisect_steps=3)
    # sweep ascending; bracket (4, 6) -> 5 passes -> (5, 6) -> 5.5 fails -> (5, 5.5) -> 5.25 passes
    assert measured == [2, 4, 6, 8, 5.0, 5.5, 5.25]
    assert (goodput.rate, goodput.lo, goodput.hi, goodput.lower_bound) == (5.25, 5.25, 5.5, False)
    assert set(points) == set(measured)
    measured.clear()  # stop_at_miss: nothing above 6 (the first miss), the same bracket and bisection
    stopped, _ = search_goodput(curve, [8, 2, 4, 6, 10], target=0.9, bisect_steps=3, stop_at_miss=True)
    assert measured == [2, 4, 6, 5.0, 5.5, 5.25] and stopped == goodput


def test_prompts_per_rate():
    from benchmarks.goodput.sweep import prompts_at
    assert prompts_at(100, 4, 0) == 100 and prompts_at(100, 4, 20) == 100  # 80 < 100
    assert prompts_at(100, 32, 20) == 640 and prompts_at(10, 2.5, 5) == 13  # arrivals span ~20 s / 5 s


def test_search_edges():
    goodput, points = search_goodput(lambda r: 0.0, [2, 4], 0.9, bisect_steps=2)
    assert sorted(points) == [0.5, 1.0, 2, 4]  # bisects below the lowest rate, from 0
    assert (goodput.rate, goodput.lo, goodput.hi) == (0.0, None, 0.5)
    goodput, points = search_goodput(lambda r: 1.0, [2, 4], 0.9, bisect_steps=5)
    assert sorted(points) == [2, 4] and goodput.lower_bound and goodput.rate == 4
    goodput, points = search_goodput(lambda r: float(r < 3), [2, 4], 0.9, bisect_steps=5, min_step=0.5)
    assert sorted(points) == [2, 3.0, 4]  # (2, 3) is under 2 x 0.5 wide: stop
    assert goodput_of({1: 0.95}, 0.9).to_json() == {"rate": 1, "bracket": [1, None], "lower_bound": True}
    with pytest.raises(ValueError):
        search_goodput(lambda r: 1.0, [0, 2], 0.9, 0)


def test_topology_specs():
    t = Topology.parse("pd:2p3d:read:ipc:gpus=2")
    assert (t.kind, t.prefill, t.decode, t.kv_mode, t.transport, t.gpus) == ("pd", 2, 3, "read", "ipc", 2)
    assert t.name == "pd2p3d-read-ipc-g2" and t.num_instances == 5
    assert Topology.parse("pd:1p1d").name == "pd1p1d-write-tcp"
    c = Topology.parse("colloc:4:name=baseline")
    assert (c.instances, c.name, c.direct, c.num_instances) == (4, "baseline", False, 4)
    assert Topology.parse("colloc:1:direct").direct
    for bad in ("colloc:x", "pd:2p", "pd:1p1d:udp", "colloc:2:direct", "ring:1", "colloc:1:tp=2"):
        with pytest.raises(ValueError):
            Topology.parse(bad)


def test_topology_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"kind": "colloc", "instances": 2, "server_args": "--max-num-seqs 64"},
                                {"kind": "pd", "prefill": 1, "decode": 2, "decode_args": ["--max-num-seqs", "128"]}]))
    a, b = Topology.from_file(path)
    assert a.server_args == ("--max-num-seqs", "64") and b.decode_args == ("--max-num-seqs", "128")
    path.write_text(json.dumps([{"kind": "colloc", "replicas": 2}]))
    with pytest.raises(ValueError, match="replicas"):
        Topology.from_file(path)


def test_gpu_assignment_and_instance_flags():
    t = Topology.parse("pd:1p2d:gpus=2")
    assert instance_gpus(t, ("0", "1", "2", "3", "4", "5")) == [("0", "1"), ("2", "3"), ("4", "5")]
    assert instance_gpus(t, ()) == [(), (), ()]
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        instance_gpus(t, ("0", "1"))
    options = LaunchOptions(server_args=("--model", "m"), gpus=("0", "1", "2", "3", "4", "5"))
    argv = instance_argv(t, "decode", options, "127.0.0.1:9")
    assert argv == ["--role", "decode", "--router-address", "127.0.0.1:9", "--kv-transport", "tcp",
                    "--model", "m", "--tensor-parallel-size", "2"]
    # on GPUs every process sees all of them (ipc opens peers by device index): an instance names its first
    argv = instance_argv(t, "decode", LaunchOptions(gpus=("4", "5", "6", "7", "2", "3")), "127.0.0.1:9", ("2", "3"))
    assert argv[-4:] == ["--tensor-parallel-size", "2", "--device", "cuda:4"]
    given = LaunchOptions(server_args=("--device=cuda:1",), gpus=options.gpus)
    assert "cuda:2" not in instance_argv(t, "decode", given, "127.0.0.1:9", ("2", "3"))
    dp = LaunchOptions(server_args=("--data-parallel-size", "2"), gpus=options.gpus)
    assert "--tensor-parallel-size" not in instance_argv(t, "prefill", dp, "127.0.0.1:9")
    assert instance_argv(Topology.parse("colloc:1"), "collocated", options, None) == ["--model", "m"]


def test_dummy_model_tokenizer_covers_the_vocabulary(tmp_path):
    """Reference: random ids over the whole vocabulary survive decode -> encode unchanged."""
    import random

    from transformers import AutoTokenizer

    from benchmarks.dummy_model import write_dummy_model

    out = write_dummy_model("qwen3-30b-a3b", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(out)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert len(tok) == vocab and tok.eos_token_id == 0
    rng = random.Random(0)
    ids = [rng.randrange(2, vocab) for _ in range(500)] + [vocab - 1, 2, 12, 121]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_merge_reports_unions_rates_and_recomputes_goodput():
    from benchmarks.goodput.merge import merge_reports

    def report(name, points, **over):
        base = {"workload": {"random_input_len": 2000}, "slo": {"ttft_ms": 1000, "tpot_ms": 50}, "target": 0.9,
                "definition": "vllm", "server_args": ["--model", "m"]}
        return {**base, **over, "topologies": [{"name": name, "topology": {"kind": "colloc"},
                                                "points": [{"rate": r, "attainment": a, "attainment_strict": s}
                                                           for r, a, s in points]}]}

    first = report("colloc2", [(4, 1.0, 0.95), (8, 1.0, 0.5), (16, 1.0, 0.1)])  # every rate met: a lower bound
    later = report("colloc2", [(32, 0.6, 0.0), (16, 0.95, 0.0)])  # a later run: 32 misses, 16 re-measured
    other = report("pd1p1d", [(4, 0.5, 0.5)])
    merged = merge_reports([first, later, other])
    colloc, pd = merged["topologies"]
    assert [p["rate"] for p in colloc["points"]] == [4, 8, 16, 32]
    assert colloc["points"][2]["attainment"] == 0.95  # the later run's 16
    assert colloc["goodput"] == {"rate": 16, "bracket": [16, 32], "lower_bound": False}
    assert colloc["goodput_strict"] == {"rate": 4, "bracket": [4, 8], "lower_bound": False}
    assert pd["goodput"]["rate"] == 0.0 and merged["merged_from"] == 3
    with pytest.raises(ValueError, match="slo"):
        merge_reports([first, report("x", [(1, 1.0, 1.0)], slo={"ttft_ms": 200, "tpot_ms": 50})])


def test_misses_say_why_requests_miss():
    from benchmarks.goodput.slo import misses
    from benchmarks.serve import RequestRecord

    slo = SLO(ttft_ms=1000, tpot_ms=50)
    fine = RequestRecord(0, 10, 4, ttft_s=0.2, e2el_s=0.26, itl_s=[0.02, 0.02, 0.02], output_tokens=4, success=True)
    late = RequestRecord(1, 10, 4, ttft_s=1.5, e2el_s=1.56, itl_s=[0.02, 0.02, 0.02], output_tokens=4, success=True)
    # PD's failure: the first gap (the KV's wait) is long, so TPOT goes over; later gaps are fine
    stalled = RequestRecord(2, 10, 4, ttft_s=0.2, e2el_s=0.64, itl_s=[0.4, 0.02, 0.02], output_tokens=4, success=True)
    failed = RequestRecord(3, 10, 4, success=False, error="boom")
    m = misses([fine, late, stalled, failed], slo)
    assert m["failed"] == m["ttft"] == m["tpot"] == m["itl"] == 0.25
    assert m["first_gap_p50_ms"] == pytest.approx(20) and m["max_later_gap_p50_ms"] == pytest.approx(20)
    assert misses([], slo)["first_gap_p50_ms"] is None


def test_engine_phases_are_means_of_the_requests_between_snapshots():
    """Per role, (sum after - sum before) / (count after - count before), in ms; phases no request
    reached in between are left out; instances of one role pool their requests."""
    from benchmarks.goodput.sweep import engine_phases_ms
    before = {"decode0": {"queue": (1.0, 10), "kv_transfer_wait": (2.0, 10)}, "prefill0": {"prefill": (5.0, 10)}}
    after = {"decode0": {"queue": (1.3, 13), "kv_transfer_wait": (2.0, 10)}, "decode1": {"queue": (0.1, 1)},
             "prefill0": {"prefill": (5.6, 12)}}
    got = engine_phases_ms(before, after)
    assert got.keys() == {"decode", "prefill"} and got["decode"].keys() == {"queue"}
    assert got["decode"]["queue"] == pytest.approx(1000 * 0.4 / 4)
    assert got["prefill"]["prefill"] == pytest.approx(300.0)

"""benchmarks.profile_decode's chain attribution (what each kernel of a PDL chain adds to a replay's
span) on hand-made timelines: no GPU, no timing asserted."""
import pytest

from benchmarks.profile_decode import chain_attribution


def test_a_serial_chain_is_charged_its_durations_and_gaps():
    # a: 0-10, b: 12-20 (2 us idle before it), a: 20-25
    out = chain_attribution([[("b", 12, 20), ("a", 0, 10), ("a", 20, 25)]])
    rows = {k["kernel"]: k for k in out["kernels"]}
    assert out["span_us"] == 25
    assert rows["a"]["count"] == 2 and rows["a"]["exposed_us"] == 15 and rows["a"]["idle_before_us"] == 0
    assert rows["b"]["exposed_us"] == 8 and rows["b"]["idle_before_us"] == 2


def test_overlapped_kernels_are_charged_only_past_the_kernels_ahead():
    # PDL: b starts at 6 while a runs to 10 and ends at 14; c starts at 9 and ends at 13, inside b
    out = chain_attribution([[("a", 0, 10), ("b", 6, 14), ("c", 9, 13)]])
    rows = {k["kernel"]: k for k in out["kernels"]}
    assert rows["a"]["exposed_us"] == 10 and rows["b"]["exposed_us"] == 4 and rows["c"]["exposed_us"] == 0
    assert out["span_us"] == 14 == sum(k["exposed_us"] + k["idle_before_us"] for k in out["kernels"])


def test_replays_are_averaged():
    out = chain_attribution([[("a", 0, 4), ("b", 5, 9)], [("a", 100, 106), ("b", 106, 108)]])
    rows = {k["kernel"]: k for k in out["kernels"]}
    assert out["span_us"] == pytest.approx(8.5)
    assert rows["a"]["exposed_us"] == 5 and rows["b"]["exposed_us"] == 3 and rows["b"]["idle_before_us"] == 0.5
    assert [k["kernel"] for k in out["kernels"]] == ["a", "b"]  # by what they add

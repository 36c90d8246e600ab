"""benchmarks.profile_decode's chain attribution (what each kernel of a PDL chain adds to a replay's
span) on hand-made timelines: no GPU, no timing asserted."""
import json
import sys

import pytest
import torch

from benchmarks import profile_decode
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


def test_layer_chain_finds_the_repeating_layer_and_averages_its_positions():
    from benchmarks.profile_decode import layer_chain
    # embed, then 3 layers of (gemm 10 us, attn 4 us, gemm 6 us), then the head; the third layer's
    # attention takes 7 us, and each layer's second GEMM overlaps the attention by 1 us (PDL)
    events, t = [("embed", 0, 2)], 2.0
    for layer in range(3):
        attn = 7 if layer == 2 else 4
        events += [("gemm", t, t + 10), ("attn", t + 10, t + 10 + attn), ("gemm", t + 9 + attn, t + 15 + attn)]
        t += 15 + attn
    events.append(("head", t, t + 5))
    out = layer_chain([events, events])
    assert out["period"] == 3 and out["layers"] == 3
    rows = out["kernels"]
    assert [r["kernel"] for r in rows] == ["gemm", "attn", "gemm"]
    assert rows[0]["exposed_us"] == pytest.approx(10) and rows[1]["exposed_us"] == pytest.approx(5)
    assert rows[2]["exposed_us"] == pytest.approx(5) and rows[2]["duration_us"] == pytest.approx(6)


def test_layer_chain_of_nothing_is_empty():
    from benchmarks.profile_decode import layer_chain
    assert layer_chain([])["kernels"] == [] and layer_chain([[("a", 0, 1)]])["period"] == 0


def test_a_plans_file_is_installed_while_profiling_and_removed_after(tmp_path, monkeypatch):
    """--plans F: the decode attention's plan_tune override is in place while the profile runs (the engine is built
    and its graphs captured inside it), and the rule is back after."""
    from tandem.kernels.triton import attention
    f = tmp_path / "p.json"
    f.write_text(json.dumps(dict(walks=[dict(what="decode attention", best={"num_stages": 3})])))
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)  # one decode token of a Llama-3-8B-shaped layer
    args = (q, 4, 1, 8, 1, 8192, False, 1)  # (GQA group 4, 8 KV heads, graphs' 8192-key bound, fp8 cache)
    rule = attention._launch_plans
    seen = []
    monkeypatch.setattr(profile_decode, "profile",
                        lambda a: seen.append(attention._launch_plans(*args)[0]["num_stages"]))  # (the rule: 1)
    monkeypatch.setattr(sys, "argv", ["profile_decode", "--plans", str(f)])
    profile_decode.main()
    assert seen == [3] and rule(*args)[0]["num_stages"] != 3
    assert attention._launch_plans is rule

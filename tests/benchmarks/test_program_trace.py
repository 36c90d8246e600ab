"""benchmarks/program_trace.py without a GPU: the summaries of hand-made stamps against the figures worked out by
hand, and the hook that hands the TMA GEMM and the attention their trace list only while a graph is being captured."""
import pytest
import torch

from benchmarks import program_trace


def _stamps(rows):
    """Rows (start, released, weight_in, end, sm[, issued]) in kernels/triton/trace.py's columns."""
    out = torch.zeros(len(rows), 8, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row)
    return out


def test_summary_is_relative_to_the_release_of_the_wait():
    # four programs on three SMs; the wait released at 10_000 ns (the median of 10_000 x 3 and 10_200)
    s = program_trace.summarize(_stamps([(2_000, 10_000, 10_300, 12_000, 5),  # early, its weight in at the release
                                         (9_500, 10_000, 15_000, 16_000, 5),  # started 0.5 us ahead: not "early"
                                         (10_000, 10_000, 14_000, 20_000, 7),  # started at the release
                                         (1_000, 10_200, 11_000, 13_000, 9)]))
    assert (s["programs"], s["sms"], s["most_on_an_sm"], s["started_early"]) == (4, 3, 2, 2)
    # quantiles 0, 0.5, 0.9, 1, linear between ranks: start [-9, -8, -0.5, 0], weight [0.3, 1, 4, 5], end [2, 3, 6, 10]
    assert s["start"] == pytest.approx([-9.0, -4.25, -0.15, 0.0])
    assert s["weight_in"] == pytest.approx([0.3, 2.5, 4.7, 5.0])
    assert s["end"] == pytest.approx([4.5, 10.0])
    assert s["weight_after_start"] == pytest.approx(6.9)  # median of 8.3, 5.5, 4, 10


def test_mean_summary_averages_scalars_and_lists():
    a = dict(programs=4, start=[0.0, 2.0])
    b = dict(programs=2, start=[2.0, 4.0])
    assert program_trace.mean_summary([a, b]) == dict(programs=3.0, start=[1.0, 3.0])


def _step():
    """A hand-made traced step: the qkv ring of the layer before, then one layer, then an attention launch whose
    layer has no TMA GEMM, then launches the replays never ran (rows 0)."""
    zeros = torch.zeros(4, 8, dtype=torch.int64)
    return [("ring 6144x4096", _stamps([(100, 200, 300, 4_000, 0), (100, 200, 300, 5_000, 1)])),
            ("attention", _stamps([(1_000, 4_000, 0, 9_000, 1), (1_500, 4_200, 0, 10_000, 2),
                                   (1_200, 0, 0, 0, 3)])),  # no keys: returned after its start stamp
            ("merge", _stamps([(8_000, 10_500, 0, 12_000, 4), (8_100, 10_600, 0, 12_500, 5)])),
            ("tma_gemm", _stamps([(9_000, 13_000, 14_000, 16_000, 1), (12_500, 13_000, 14_500, 17_000, 2)])),
            ("ring 28672x4096", _stamps([(14_000, 17_100, 18_000, 30_000, 3, 14_500)])),
            ("attention", _stamps([(31_000, 32_000, 0, 33_000, 1)])),
            ("ring 4096x14336", _stamps([(33_000, 33_500, 34_000, 40_000, 2)])),
            ("attention", zeros), ("tma_gemm", zeros)]


def test_layers_put_each_launch_on_the_gemm_clock():
    step = _step()
    (lay,) = program_trace.layers(step)  # the second attention's layer has no TMA GEMM; the third never ran
    assert [la["name"] for la in lay] == ["attention", "merge", "tma_gemm", "ring 28672x4096"]
    attn, merge, gemm, ring = lay
    # the GEMM released at 13_000 ns (0 us); the attention's program without keys is left out
    assert (attn["programs"], attn["sms"], attn["early"]) == (2, 2, 2)
    assert (attn["start"], attn["released"], attn["end"], attn["last"]) == pytest.approx((-12.0, -8.9, -3.5, -3.0))
    assert attn["weight_in"] is None and attn["exposed"] == pytest.approx(5.0)  # after the qkv ring's last end
    assert (merge["last"], merge["exposed"]) == pytest.approx((-0.5, 2.5))
    assert (gemm["programs"], gemm["early"], gemm["released"]) == (2, 1, 0.0)
    assert gemm["stamps"] is step[3][1]  # as they were (the first table's summarize reads them)
    assert (gemm["weight_in"], gemm["end"], gemm["last"], gemm["exposed"]) == pytest.approx((1.25, 3.5, 4.0, 4.5))
    assert (ring["early"], ring["released"], ring["weight_in"]) == (1, pytest.approx(4.1), pytest.approx(5.0))
    assert ring["issued"] == pytest.approx(1.5) and gemm["issued"] is None  # (only the rings stamp it)
    assert (ring["last"], ring["exposed"]) == pytest.approx((17.0, 13.0))
    rows = [program_trace.format_launch("#0", la) for la in lay]
    assert rows[0].split() == ["#0", "attention", "2", "2", "2", "-12.0", "-8.9", "-", "-", "-3.5", "-3.0", "5.0"]
    assert rows[3].split()[1:3] == ["ring", "28672x4096"]


def test_mean_layer_averages_the_layers_named_as_the_first():
    lay = program_trace.layers(_step())[0]
    other = [dict(la, last=la["last"] + 2.0) for la in lay]
    odd = lay[:2]  # another sequence of launches: left out
    mean = program_trace.mean_layer([lay, other, odd])
    assert [m["name"] for m in mean] == [la["name"] for la in lay]
    assert [m["last"] for m in mean] == pytest.approx([la["last"] + 1.0 for la in lay])
    assert mean[0]["weight_in"] is None and mean[2]["weight_in"] == pytest.approx(1.25)


def test_hook_passes_a_trace_list_only_while_capturing(monkeypatch):
    from tandem.kernels.triton import attention, fp8_tma
    calls = []
    monkeypatch.setattr(fp8_tma, "fp8_tma_linear", lambda *a, **kw: calls.append(("gemm", kw)) or "out")
    monkeypatch.setattr(attention, "_paged_attention", lambda *a, **kw: calls.append(("attention", kw)) or "attn")
    monkeypatch.setattr(fp8_tma, "fp8_tma_ring_linear", lambda *a, **kw: calls.append(("ring", kw)) or "ring")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    fakes = fp8_tma.fp8_tma_linear, attention._paged_attention
    hook = program_trace.TracedLaunches("cpu")
    try:
        assert fp8_tma.fp8_tma_linear("x", pdl=True) == "out" and calls[-1] == ("gemm", dict(pdl=True))
        assert attention._paged_attention("q", pdl=True) == "attn" and calls[-1] == ("attention", dict(pdl=True))
        capturing[0] = True
        fp8_tma.fp8_tma_linear("x", pdl=True)
        assert calls[-1][1]["trace"] is hook.launches and calls[-1][1]["pdl"] is True
        attention._paged_attention("q")
        assert calls[-1] == ("attention", dict(trace=hook.launches))
        assert fp8_tma.fp8_tma_ring_linear("xq") == "ring" and calls[-1] == ("ring", dict(trace=hook.launches))
        from tandem.kernels.triton.trace import trace_args
        cpu = torch.device("cpu")
        a, b = (trace_args(hook.launches, name, n, cpu)["trace_ptr"] for name, n in (("a", 3), ("b", 2)))
        assert a.shape == (3, 8) and b.shape == (2, 8) and b.data_ptr() == a.data_ptr() + 3 * 64  # one arena, in turn
        assert [name for name, _ in hook.launches] == ["a", "b"] and not hook.launches.arena.any()
    finally:
        hook.restore()
    assert (fp8_tma.fp8_tma_linear, attention._paged_attention) == fakes

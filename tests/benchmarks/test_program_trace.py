"""benchmarks/program_trace.py without a GPU: the summaries of hand-made stamps against the figures worked out by
hand, and the hook that hands the TMA GEMM and the attention their trace list only while a graph is being captured."""
import pytest
import torch

from benchmarks import program_trace


def _stamps(rows):
    out = torch.zeros(len(rows), 8, dtype=torch.int64)
    for i, (start, released, weight_in, end, sm) in enumerate(rows):
        out[i, :5] = torch.tensor([start, released, weight_in, end, sm])
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


def test_layers_cut_at_each_attention_and_keep_the_first_gemm():
    z = lambda v: torch.full((2, 8), v, dtype=torch.int64)  # noqa: E731
    launches = [("tma_gemm", z(9)),  # before any attention: dropped
                ("attention", z(1)), ("merge", z(2)), ("tma_gemm", z(3)), ("tma_gemm", z(4)),
                ("attention", z(5)), ("tma_gemm", z(6)),
                ("attention", z(7)), ("tma_gemm", z(0))]  # never written: dropped
    lays = program_trace.layers(launches)
    assert [sorted(lay) for lay in lays] == [["attention", "merge", "tma_gemm"], ["attention", "tma_gemm"]]
    assert int(lays[0]["tma_gemm"][0, 0]) == 3 and int(lays[1]["attention"][0, 0]) == 5


def test_layer_timeline_is_relative_to_the_gemm_release():
    # the GEMM's wait released at 20_000 ns; two attention programs with keys on SMs 1 and 2, one without (its row
    # past the start left 0)
    attention = _stamps([(1_000, 2_000, 0, 14_000, 1), (1_500, 2_500, 0, 16_000, 2), (1_200, 0, 0, 0, 3)])
    merge = _stamps([(15_000, 16_500, 0, 19_000, 4), (15_500, 16_400, 0, 19_800, 5)])
    gemm = _stamps([(10_000, 20_000, 20_300, 25_000, 1),  # on SM 1 while its attention program ran: beside
                    (15_000, 20_000, 21_000, 27_000, 1),  # on SM 1 after it ended
                    (12_000, 20_000, 20_500, 26_000, 3),  # on SM 3, where no program with keys ran
                    (15_800, 20_000, 22_000, 24_000, 2)])  # on SM 2 before its attention program's end: beside
    t = program_trace.layer_timeline(dict(attention=attention, merge=merge, tma_gemm=gemm))
    assert (t["attention"], t["attention_sms"], t["beside"]) == (2, 2, 2)
    # start -19, wait released (median of 2.0, 2.5 us) -17.75, end median -5, max -4
    assert t["attention_span"] == pytest.approx([-19.0, -17.75, -5.0, -4.0])
    assert t["merge_span"] == pytest.approx([-5.0, -0.2])
    assert t["gemm_span"] == pytest.approx([-6.5, 7.0])  # start median of 10, 12, 15, 15.8 us: 13.5
    assert "merge_span" not in program_trace.layer_timeline(dict(attention=attention, tma_gemm=gemm))


def test_hook_passes_a_trace_list_only_while_capturing(monkeypatch):
    from tandem.kernels.triton import attention, fp8_tma
    calls = []
    monkeypatch.setattr(fp8_tma, "fp8_tma_linear", lambda *a, **kw: calls.append(("gemm", kw)) or "out")
    monkeypatch.setattr(attention, "_paged_attention", lambda *a, **kw: calls.append(("attention", kw)) or "attn")
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
        from tandem.kernels.triton.trace import trace_args
        a, b = (trace_args(hook.launches, name, n, torch.device("cpu"))["trace_ptr"] for name, n in (("a", 3), ("b", 2)))
        assert a.shape == (3, 8) and b.shape == (2, 8) and b.data_ptr() == a.data_ptr() + 3 * 64  # one arena, in turn
        assert [name for name, _ in hook.launches] == ["a", "b"] and not hook.launches.arena.any()
    finally:
        hook.restore()
    assert (fp8_tma.fp8_tma_linear, attention._paged_attention) == fakes

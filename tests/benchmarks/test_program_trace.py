"""benchmarks/program_trace.py without a GPU: the summary of hand-made stamps against the figures worked out by
hand, and the hook that hands fp8_tma_linear its trace list only while a graph is being captured."""
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


def test_hook_passes_a_trace_list_only_while_capturing(monkeypatch):
    from tandem.kernels.triton import fp8_tma
    calls = []
    monkeypatch.setattr(fp8_tma, "fp8_tma_linear", lambda *a, **kw: calls.append(kw) or "out")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    fake = fp8_tma.fp8_tma_linear
    hook = program_trace.TracedTMAGemm()
    try:
        assert fp8_tma.fp8_tma_linear("x", pdl=True) == "out" and calls[-1] == dict(pdl=True)
        capturing[0] = True
        fp8_tma.fp8_tma_linear("x", pdl=True)
        assert calls[-1]["trace"] is hook.buffers and calls[-1]["pdl"] is True
    finally:
        hook.restore()
    assert fp8_tma.fp8_tma_linear is fake

"""Tests of the serving benchmark client (benchmarks/serve.py).

Reference: hand-computed percentiles/goodput for summarize(); for the end-to-end tests, a fake
OpenAI-compatible server on 127.0.0.1 that streams a known number of tokens with known delays.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from benchmarks.serve import (BenchmarkConfig, RequestRecord, arrival_intervals, build_prompts,
                              config_from_args, main, meets_slos, parse_args, percentile,
                              run_benchmark, sample_lengths, summarize)

FIRST_TOKEN_DELAY_S = 0.05
ITL_DELAY_S = 0.005


# ---------------------------------------------------------------- summarize() on synthetic records

def _record(i: int, ttft: float, itls: list[float], tokens: int, success: bool = True,
            prompt_len: int = 10) -> RequestRecord:
    e2el = ttft + sum(itls)
    return RequestRecord(index=i, prompt_len=prompt_len, max_tokens=tokens, ttft_s=ttft, e2el_s=e2el,
                         itl_s=itls, output_tokens=tokens, success=success,
                         error="" if success else "HTTP 500: boom")


def test_percentile_matches_numpy_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 0.99*3 = 2.97 -> 3 + 0.97*(4-3)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summarize_hand_computed():
    records = [
        _record(0, 0.100, [0.010, 0.010, 0.010], 4),  # tpot 10 ms, e2el 130 ms
        _record(1, 0.200, [0.020, 0.020, 0.020], 4),  # tpot 20 ms, e2el 260 ms
        _record(2, 0.300, [0.030], 2),                # tpot 30 ms, e2el 330 ms
        _record(3, 0.400, [], 1),                     # single token: no TPOT, no ITL
        _record(4, 0.0, [], 0, success=False),
    ]
    s = summarize(records, duration_s=2.0, percentiles=(90, 99))
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 11
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(5.5)
    assert s["total_token_throughput"] == pytest.approx(25.5)
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p90_ttft_ms"] == pytest.approx(370.0)  # rank 2.7 -> 300 + 0.7*100
    assert s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["mean_tpot_ms"] == pytest.approx(20.0)
    assert s["median_tpot_ms"] == pytest.approx(20.0)
    itls = [10, 10, 10, 20, 20, 20, 30]
    assert s["mean_itl_ms"] == pytest.approx(sum(itls) / 7)
    assert s["median_itl_ms"] == pytest.approx(20.0)
    assert s["p99_itl_ms"] == pytest.approx(29.4)  # rank 5.94 -> 20 + 0.94*10
    assert s["mean_e2el_ms"] == pytest.approx((130 + 260 + 330 + 400) / 4)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert "request_goodput" not in s
    json.dumps(s)  # the summary goes into the result file as-is


def test_summarize_goodput_and_slo_attainment():
    records = [
        _record(0, 0.100, [0.010, 0.010, 0.010], 4),
        _record(1, 0.200, [0.020, 0.020, 0.020], 4),
        _record(2, 0.300, [0.030], 2),
        _record(3, 0.400, [], 1),
        _record(4, 0.0, [], 0, success=False),
    ]
    s = summarize(records, duration_s=2.0, slos_ms={"ttft": 250})
    assert s["request_goodput"] == pytest.approx(1.0)  # requests 0 and 1 in 2 s
    assert s["slo_attainment_pct"] == pytest.approx(40.0)  # 2 of 5; the failed one counts against
    s = summarize(records, duration_s=2.0, slos_ms={"ttft": 1000, "tpot": 15})
    assert s["request_goodput"] == pytest.approx(1.0)  # 0 (10 ms) and 3 (one token, no TPOT)
    s = summarize(records, duration_s=2.0, slos_ms={"itl": 25, "e2el": 300})
    assert s["request_goodput"] == pytest.approx(1.0)  # 0 and 1; 2 has a 30 ms gap, 3 is 400 ms
    # ITL is checked on every gap, not the mean.
    assert not meets_slos(_record(9, 0.1, [0.001, 0.001, 0.050], 4), {"itl": 20})


def test_summarize_all_failed_does_not_crash():
    s = summarize([_record(0, 0, [], 0, success=False)], duration_s=0.0, slos_ms={"ttft": 100})
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["request_goodput"] == 0.0


# ---------------------------------------------------------------- workload generation

def test_sample_lengths_respect_range_ratio():
    config = BenchmarkConfig(random_input_len=100, random_output_len=10, random_range_ratio=0.5,
                             num_prompts=500)
    lengths = sample_lengths(config, random.Random(0))
    assert all(50 <= i <= 150 and 5 <= o <= 15 for i, o in lengths)
    assert len({i for i, _ in lengths}) > 20
    with pytest.raises(ValueError):
        sample_lengths(BenchmarkConfig(random_range_ratio=1.0), random.Random(0))


def test_build_prompts_share_prefix_and_lengths():
    config = BenchmarkConfig(random_input_len=16, random_output_len=4, random_prefix_len=8, num_prompts=5,
                             vocab_size=1000)
    prompts = build_prompts(config, random.Random(0), "token-ids")
    assert all(len(p.body) == p.prompt_len == 24 and p.max_tokens == 4 for p in prompts)
    assert all(p.body[:8] == prompts[0].body[:8] for p in prompts)
    assert all(100 <= t < 1000 for p in prompts for t in p.body)
    words = build_prompts(config, random.Random(0), "words")
    assert all(len(p.body.split()) == p.prompt_len == 24 for p in words)


class _WordTokenizer:
    """Stand-in for an HF tokenizer: one token per whitespace-separated word, id 0 special."""

    all_special_ids = [0]
    vocab = [f"w{i}" for i in range(50)]

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.index(w) for w in text.split()]


def test_build_prompts_with_tokenizer_counts_exactly():
    config = BenchmarkConfig(random_input_len=20, random_output_len=3, random_prefix_len=5, num_prompts=4,
                             random_range_ratio=0.5)
    prompts = build_prompts(config, random.Random(0), "tokenizer-text", _WordTokenizer())
    expected = [5 + n for n, _ in sample_lengths(config, random.Random(0))]
    assert [p.prompt_len for p in prompts] == expected
    assert all(len(p.body.split()) == p.prompt_len and "w0" not in p.body.split() for p in prompts)
    assert len({" ".join(p.body.split()[:5]) for p in prompts}) == 1  # shared prefix


def test_arrival_intervals_poisson_mean_and_inf():
    assert arrival_intervals(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    gaps = arrival_intervals(20000, 10.0, 1.0, random.Random(0))
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_intervals(20000, 10.0, 0.5, random.Random(0))
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.05)  # same rate, more variance


def test_cli_slo_flags_merge():
    config = config_from_args(parse_args(["--goodput", "ttft:500", "tpot:50", "--slo-itl-ms", "80",
                                          "--metric-percentiles", "50,90,99.9", "--request-rate", "inf"]))
    assert config.slos_ms == {"ttft": 500.0, "tpot": 50.0, "itl": 80.0}
    assert config.metric_percentiles == (50.0, 90.0, 99.9) and math.isinf(config.request_rate)
    with pytest.raises(SystemExit):
        parse_args(["--goodput", "latency:5"])


# ---------------------------------------------------------------- fake OpenAI-compatible server

def _fake_app(counters: dict[str, int]) -> web.Application:
    """Routes /{mode}/v1/...; modes: ok, nousage, textonly (refuses token ids), flaky (every 3rd
    streamed request is HTTP 500), broken (drops the connection after two tokens)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        mode, body = request.match_info["mode"], await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if isinstance(prompt, list) and mode == "textonly":
            return web.json_response({"error": {"message": "prompt must be a string"}}, status=400)
        # Token-id prompts count exactly; text gets one extra token, like a BOS, so usage is visible.
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split()) + 1
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x", "index": 0}]})
        counters[mode] = counters.get(mode, 0) + 1
        if mode == "flaky" and counters[mode] % 3 == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj: object) -> None:
            await response.write(f"data: {json.dumps(obj)}\n\n".encode())

        if chat:  # a role-only first chunk must not count as the first token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(FIRST_TOKEN_DELAY_S if i == 0 else ITL_DELAY_S)
            piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            await send({"choices": [{"index": 0, **piece}]})
            if mode == "broken" and i == 1:
                request.transport.close()
                return response
        if mode != "nousage":
            await send({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                 "total_tokens": prompt_tokens + n}})
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/{mode}/v1/models", models)
    app.router.add_post("/{mode}/v1/completions", generate)
    app.router.add_post("/{mode}/v1/chat/completions", generate)
    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    """Serves the fake app from a thread on a free 127.0.0.1 port; yields the base URL root."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_fake_app({}), handle_signals=False)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def _config(base_url: str, **overrides: object) -> BenchmarkConfig:
    defaults = dict(base_url=base_url, random_input_len=12, random_output_len=6, num_prompts=6,
                    max_concurrency=2, ignore_eos=True, disable_tqdm=True, vocab_size=1000)
    return BenchmarkConfig(**(defaults | overrides))


def test_e2e_completions_token_ids_via_cli(fake_server, tmp_path, capsys):
    argv = ["--base-url", f"{fake_server}/ok", "--random-input-len", "12", "--random-output-len", "6",
            "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos", "--vocab-size", "1000",
            "--goodput", "ttft:10000", "--disable-tqdm", "--result-dir", str(tmp_path),
            "--result-filename", "run.json", "--plot"]
    assert main(argv) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads((tmp_path / "run.json").read_text())
    assert (tmp_path / "run.png").stat().st_size > 0
    assert data["model"] == "fake-model" and data["prompt_format"] == "token-ids"
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == 36 and s["total_input_tokens"] == 72
    assert s["request_goodput"] > 0 and s["slo_attainment_pct"] == 100.0
    assert len(data["requests"]) == 6
    for r in data["requests"]:
        assert r["success"] and r["output_tokens"] == 6 and len(r["itl_s"]) == 5
        assert r["ttft_s"] >= FIRST_TOKEN_DELAY_S
        assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / 5)
    assert s["median_itl_ms"] >= ITL_DELAY_S * 1e3 * 0.8


def test_e2e_chat_without_usage_counts_chunks(fake_server):
    result = asyncio.run(run_benchmark(_config(f"{fake_server}/nousage", model="fake-model",
                                               endpoint="/v1/chat/completions")))
    assert result.prompt_format == "words"
    assert result.summary["completed"] == 6
    for r in result.records:
        assert r.output_tokens == 6 and r.ttft_s >= FIRST_TOKEN_DELAY_S
        assert r.prompt_len == 12  # no usage: the client-side word count stands


def test_e2e_text_fallback_uses_server_prompt_tokens(fake_server):
    result = asyncio.run(run_benchmark(_config(f"{fake_server}/textonly", request_rate=200.0)))
    assert result.prompt_format == "words"
    assert result.summary["completed"] == 6
    assert all(r.prompt_len == 13 for r in result.records)  # usage.prompt_tokens wins


def test_e2e_http_500_reported_as_failed(fake_server):
    result = asyncio.run(run_benchmark(_config(f"{fake_server}/flaky", num_prompts=9)))
    s = result.summary
    assert (s["completed"], s["failed"]) == (6, 3)
    assert list(s["errors"]) == ['HTTP 500: {"error": {"message": "boom"}}']
    assert s["total_output_tokens"] == 36


def test_e2e_broken_streams_reported_not_raised(fake_server, tmp_path):
    argv = ["--base-url", f"{fake_server}/broken", "--num-prompts", "3", "--random-input-len", "4",
            "--random-output-len", "5", "--disable-tqdm", "--result-dir", str(tmp_path)]
    assert main(argv) == 1  # nothing succeeded
    (written,) = tmp_path.glob("*.json")
    s = json.loads(written.read_text())["summary"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert s["mean_ttft_ms"] is None


def test_e2e_unreachable_server_reported_as_failed():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = asyncio.run(run_benchmark(_config(f"http://127.0.0.1:{port}", model="m", num_prompts=2)))
    assert result.summary["failed"] == 2
    assert all("ClientConnectorError" in r.error for r in result.records)

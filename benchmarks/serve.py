"""Serving benchmark client for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

Sends streamed /v1/completions or /v1/chat/completions requests with Poisson (or gamma, via
--burstiness) arrivals and an optional concurrency cap, and measures per request the time to
first token (TTFT), every inter-token latency (ITL), time per output token (TPOT) and the
end-to-end latency (E2EL). See benchmarks/README.md.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.datasets import (DATASETS, MIN_RANDOM_TOKEN_ID, WORDS, Prompt,  # noqa: F401 (re-exported)
                                 build_prompts, sample_lengths)

logger = logging.getLogger(__name__)

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
REQUEST_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class BenchmarkConfig:
    """Everything one benchmark run needs; built once from the CLI (or directly by a caller)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None
    tokenizer: str | None = None  # HF tokenizer folder/name for exact prompt token counts
    random_input_len: int = 1024
    random_output_len: int = 128
    random_prefix_len: int = 0
    random_range_ratio: float = 0.0
    dataset: str = "random"  # random | sharegpt | prefix-repetition (benchmarks/datasets.py)
    dataset_path: str | None = None  # sharegpt: the local JSON file
    sharegpt_output_len: int | None = None  # None: each conversation's reply length
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    vocab_size: int = 32000  # upper bound for token-id prompts when no tokenizer is given
    num_prompts: int = 200
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    slos_ms: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms, for goodput
    metric_percentiles: tuple[float, ...] = (99.0,)
    disable_tqdm: bool = False

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("/chat/completions")


@dataclass
class RequestRecord:
    """What one request did; times in seconds, start_s relative to the benchmark start."""

    index: int
    prompt_len: int  # replaced by usage.prompt_tokens when the server reports it
    max_tokens: int
    start_s: float = 0.0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one gap per streamed content chunk after the first
    output_tokens: int = 0  # usage.completion_tokens when reported, else the number of content chunks
    success: bool = False
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class BenchmarkResult:
    config: BenchmarkConfig
    model: str
    prompt_format: str  # "token-ids", "tokenizer-text", "words" or "text" (sharegpt)
    duration_s: float
    records: list[RequestRecord]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        requests = [asdict(r) | {"tpot_s": r.tpot_s} for r in self.records]
        config = asdict(self.config)
        config["request_rate"] = str(self.config.request_rate)  # "inf" is not a JSON number
        return {"date": datetime.now().isoformat(timespec="seconds"), "model": self.model,
                "prompt_format": self.prompt_format, "config": config,
                "summary": self.summary, "requests": requests}


# ---------------------------------------------------------------- metrics (pure)

def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolation percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO; ITL must hold for every gap, not on average."""
    if not record.success:
        return False
    observed_ms = {"ttft": record.ttft_s * 1e3, "tpot": (record.tpot_s or 0.0) * 1e3,
                   "itl": max(record.itl_s, default=0.0) * 1e3, "e2el": record.e2el_s * 1e3}
    return all(observed_ms[name] <= slo for name, slo in slos_ms.items())


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: dict[str, float] | None = None,
              percentiles: Sequence[float] = (99.0,)) -> dict[str, Any]:
    """Aggregate metrics over successful requests; latencies in ms, throughputs per second."""
    done = [r for r in records if r.success]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_s, "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in done)
        summary["slos_ms"] = dict(slos_ms)
        summary["request_goodput"] = good * per_s
        # Failed requests count against attainment: they met no SLO.
        summary["slo_attainment_pct"] = 100.0 * good / len(records) if records else 0.0
    series = {"ttft": [r.ttft_s for r in done], "tpot": [t for r in done if (t := r.tpot_s) is not None],
              "itl": [g for r in done for g in r.itl_s], "e2el": [r.e2el_s for r in done]}
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        summary[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else None
        summary[f"median_{name}_ms"] = percentile(ms, 50)
        for p in percentiles:
            summary[f"{_pct_name(p)}_{name}_ms"] = percentile(ms, p)
    summary["errors"] = dict(Counter(r.error for r in records if not r.success).most_common())
    return summary


# ---------------------------------------------------------------- workload

def arrival_intervals(n: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gaps between request sends: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    return [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(n)]


def request_payload(config: BenchmarkConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens,
                               "temperature": config.temperature, "stream": True,
                               "stream_options": {"include_usage": True}}
    if config.is_chat:
        payload["messages"] = [{"role": "user", "content": prompt.body}]
    else:
        payload["prompt"] = prompt.body
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM/SGLang extension; only sent when asked for
    return payload | config.extra_body


# ---------------------------------------------------------------- HTTP

async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream, as they arrive."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


def _chunk_text(chunk: dict[str, Any], is_chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""  # the usage-only chunk at the end of the stream
    if not is_chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       record: RequestRecord, is_chat: bool, t0: float) -> RequestRecord:
    """Stream one request into `record`; any failure is recorded in record.error, never raised."""
    sent = time.perf_counter()
    record.start_s = sent - t0
    last, chunks, usage, finished = sent, 0, {}, False
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for data in _sse_data(response):
                if data == "[DONE]":
                    finished = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"stream error: {str(chunk['error'])[:200]}"
                    return record
                usage = chunk.get("usage") or usage
                if _chunk_text(chunk, is_chat):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
        record.e2el_s = time.perf_counter() - sent
    except Exception as e:  # a benchmark must outlive any single request; the error is reported
        record.error = f"{type(e).__name__}: {e}"[:200]
        return record
    if not finished:
        record.error = "stream ended without [DONE]"
    elif chunks == 0:
        record.error = "no content streamed"
    else:
        record.success = True
        record.output_tokens = usage.get("completion_tokens") or chunks
        record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
    return record


async def _resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError) as e:
        raise RuntimeError(f"cannot list models at {base_url}/v1/models ({e}); is the server up? "
                           "Else pass --model") from e


async def _accepts_token_ids(session: aiohttp.ClientSession, url: str, model: str, vocab_size: int) -> bool:
    """Probe with the highest id we would send, so a smaller vocabulary is refused here, not mid-run."""
    payload = {"model": model, "prompt": [MIN_RANDOM_TOKEN_ID, vocab_size - 1], "max_tokens": 1}
    try:
        async with session.post(url, json=payload) as response:
            await response.read()
            return response.status == 200
    except aiohttp.ClientError:
        return False


async def run_benchmark(config: BenchmarkConfig) -> BenchmarkResult:
    """Send config.num_prompts streamed requests and measure them; never raises for failed requests."""
    base_url = config.base_url.rstrip("/")
    url = base_url + config.endpoint
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    rng = random.Random(config.seed)
    # limit=0: the semaphore bounds concurrency; aiohttp's default pool of 100 would queue silently.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = config.model or await _resolve_model(session, base_url)
        tokenizer = None
        if config.tokenizer:
            from transformers import AutoTokenizer  # only needed with --tokenizer

            tokenizer, prompt_format = AutoTokenizer.from_pretrained(config.tokenizer), "tokenizer-text"
        elif config.dataset == "sharegpt":
            prompt_format = "text"  # the conversations' own text
        elif not config.is_chat and await _accepts_token_ids(session, url, model, config.vocab_size):
            prompt_format = "token-ids"
        else:
            prompt_format = "words"
        logger.info("model=%s url=%s prompt_format=%s", model, url, prompt_format)
        prompts = build_prompts(config, rng, prompt_format, tokenizer)
        intervals = arrival_intervals(len(prompts), config.request_rate, config.burstiness, rng)
        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        progress = tqdm(total=len(prompts), disable=config.disable_tqdm, desc="requests")

        async def one(i: int, prompt: Prompt) -> RequestRecord:
            record = RequestRecord(index=i, prompt_len=prompt.prompt_len, max_tokens=prompt.max_tokens)
            payload = request_payload(config, model, prompt)
            if semaphore is None:
                return await send_request(session, url, payload, record, config.is_chat, t0)
            async with semaphore:
                return await send_request(session, url, payload, record, config.is_chat, t0)

        t0 = time.perf_counter()
        tasks, send_at = [], t0
        for i, prompt in enumerate(prompts):
            # Sleep to absolute send times so scheduling overhead does not lower the offered rate.
            send_at += intervals[i] if i else 0.0
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            task = asyncio.create_task(one(i, prompt))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - t0
        progress.close()
    summary = summarize(records, duration_s, config.slos_ms, config.metric_percentiles)
    return BenchmarkResult(config, model, prompt_format, duration_s, records, summary)


# ---------------------------------------------------------------- reporting

def format_summary(summary: dict[str, Any], percentiles: Sequence[float] = (99.0,)) -> str:
    """A compact plain-text table in the layout of vLLM's benchmark report."""
    def row(label: str, value: Any, digits: int = 2) -> str:
        text = "n/a" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
        return f"{label:<40}{text:>12}"

    labels = {"completed": "Successful requests:", "failed": "Failed requests:",
              "duration_s": "Benchmark duration (s):", "total_input_tokens": "Total input tokens:",
              "total_output_tokens": "Total generated tokens:", "request_throughput": "Request throughput (req/s):",
              "output_throughput": "Output token throughput (tok/s):",
              "total_token_throughput": "Total token throughput (tok/s):",
              "request_goodput": "Request goodput (req/s):", "slo_attainment_pct": "SLO attainment (%):"}
    lines = ["{:=^52}".format(" Serving Benchmark Result ")]
    if "slos_ms" in summary:
        lines.append(row("SLOs (ms):", " ".join(f"{k}<={v:g}" for k, v in summary["slos_ms"].items())))
    lines += [row(label, summary[key]) for key, label in labels.items() if key in summary]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        lines.append("{:-^52}".format(title))
        for stat in ("mean", "median", *map(_pct_name, percentiles)):
            lines.append(row(f"{stat.capitalize()} {name.upper()} (ms):", summary[f"{stat}_{name}_ms"]))
    if summary["errors"]:
        lines.append("{:-^52}".format("Errors"))
        lines += [f"{count:>6} x {message[:90]}" for message, count in list(summary["errors"].items())[:5]]
    lines.append("=" * 52)
    return "\n".join(lines)


def save_result(result: BenchmarkResult, result_dir: Path, filename: str | None = None) -> Path:
    """Write the summary and every request record as JSON; returns the file written."""
    if filename is None:
        config = result.config
        model = result.model.rstrip("/").split("/")[-1]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        filename = f"serve-{model}-{config.request_rate:g}qps-c{config.max_concurrency or 'inf'}-{stamp}.json"
    path = result_dir / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2))
    return path


def plot_result(result: BenchmarkResult, path: Path) -> Path:
    """TTFT and ITL CDFs, a TPOT histogram and output-token throughput over time, in one PNG."""
    from matplotlib.figure import Figure  # lazy: plotting is optional and matplotlib is slow to import

    done = [r for r in result.records if r.success]
    fig = Figure(figsize=(12, 8), layout="constrained")
    (ax_ttft, ax_itl), (ax_tpot, ax_tput) = fig.subplots(2, 2)
    for ax, values, label in ((ax_ttft, [r.ttft_s * 1e3 for r in done], "TTFT (ms)"),
                              (ax_itl, [g * 1e3 for r in done for g in r.itl_s], "ITL (ms)")):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set(xlabel=label, ylabel="fraction of samples", title=f"{label.split()[0]} CDF")
        ax.grid(alpha=0.3)
    ax_tpot.hist([t * 1e3 for r in done if (t := r.tpot_s) is not None], bins=40)
    ax_tpot.set(xlabel="TPOT (ms)", ylabel="requests", title="TPOT histogram")
    # Spread each request's output tokens evenly over its streamed chunks (a chunk may carry several).
    width = max(result.duration_s / 60, 0.05)
    bins = [0.0] * (int(result.duration_s / width) + 1)
    for r in done:
        t, weight = r.start_s + r.ttft_s, r.output_tokens / (len(r.itl_s) + 1)
        for gap in [0.0, *r.itl_s]:
            t += gap
            bins[min(int(t / width), len(bins) - 1)] += weight / width
    ax_tput.plot([i * width for i in range(len(bins))], bins)
    ax_tput.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput over time")
    ax_tput.grid(alpha=0.3)
    fig.suptitle(f"{result.model}: rate={result.config.request_rate:g} req/s, "
                 f"max concurrency={result.config.max_concurrency or 'inf'}")
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------- CLI

def _parse_slo(item: str) -> tuple[str, float]:
    """argparse type for one --goodput item, METRIC:MS."""
    name, _, value = item.partition(":")
    if name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC in {', '.join(SLO_METRICS)}, got {item!r}")
    return name, float(value)  # argparse reports a ValueError here as an invalid value


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """What is sent (endpoint, dataset, lengths, arrivals shape, sampling); benchmarks.goodput reuses these."""
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder/name for exact prompt token counts")
    p.add_argument("--dataset", "--dataset-name", choices=DATASETS, default="random",
                   help="random tokens, a local ShareGPT JSON (--dataset-path), or shared prefixes")
    p.add_argument("--dataset-path", default=None, help="sharegpt: ShareGPT-format JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (default: each reply's length)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="tokens after the prefix")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max_tokens of each prompt")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix shared by all prompts")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±r)")
    p.add_argument("--vocab-size", type=int, default=32000, help="token-id prompts draw ids below this")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", default=None, help="model name to send; default: first of GET /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add_workload_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument("--goodput", nargs="+", type=_parse_slo, default=[], metavar="METRIC:MS",
                   help="SLOs for goodput: ttft, tpot, itl (every gap), e2el")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="same as --goodput ttft:MS")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="same as --goodput itl:MS (every gap)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--result-dir", default="benchmarks/out")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    slos = dict(args.goodput)
    if args.slo_ttft_ms is not None:
        slos["ttft"] = args.slo_ttft_ms
    if args.slo_itl_ms is not None:
        slos["itl"] = args.slo_itl_ms
    # Flags and config fields share names (--random-input-len -> random_input_len).
    same_name = {f.name: getattr(args, f.name) for f in fields(BenchmarkConfig) if hasattr(args, f.name)}
    same_name["metric_percentiles"] = tuple(float(p) for p in args.metric_percentiles.split(","))
    return BenchmarkConfig(**same_name, slos_ms=slos)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; exit status 1 when no request succeeded."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    config = config_from_args(args)
    try:
        result = asyncio.run(run_benchmark(config))
    except (RuntimeError, ValueError, OSError) as e:  # set-up errors only; request errors are recorded
        raise SystemExit(f"error: {e}") from e
    print(format_summary(result.summary, config.metric_percentiles))
    path = save_result(result, Path(args.result_dir), args.result_filename)
    logger.info("wrote %s", path)
    if args.plot:
        logger.info("wrote %s", plot_result(result, path.with_suffix(".png")))
    return 0 if result.summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

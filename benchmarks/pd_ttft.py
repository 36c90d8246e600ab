"""PD's TTFT tax: one request at a time (c=1), the TTFT of a collocated server and of a
`--role disagg` tree (router + prefill + decode) in read and write mode, on the same flags.

Every deployment is started here, warmed up, measured with benchmarks.serve (streamed random
token-id prompts, distinct per request: no prefix-cache hits), and stopped before the next one
starts. The table shows TTFT median/p90 and the median's excess over collocated.

    python -m benchmarks.pd_ttft --device cpu --prompt-len 200               # CPU, tcp
    python -m benchmarks.pd_ttft --gpu 0 --kv-transport ipc --prompt-len 2000 \\
        --model /tmp/llama3-8b --server-args="--load-format dummy"           # both instances on cuda:0

With --trace every process runs at --log-level debug and logs when a request passes each stage
(connectors/stages.py); the table then adds, per deployment, the median time of each stage
after the client sent its request.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import ctypes
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.goodput.deployment import free_port
from benchmarks.serve import BenchmarkConfig, percentile, run_benchmark

TRACE_MARK = "pdtrace"  # DEBUG lines "pdtrace <stage> <request id> <unix time>" (see --trace)
_TRACE_RE = re.compile(rf"{TRACE_MARK} (\S+) (\S+) ([0-9.]+)")


@dataclass
class Result:
    name: str
    ttft_ms: list[float]
    stages: dict[str, float]  # stage -> median ms after the client's send (with --trace)
    overhead_ms: list[float]  # TTFT less the prefill's compute, per request (with --trace)


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphan trees if we die


def deployment_argv(name: str, args: argparse.Namespace, port: int) -> list[str]:
    """`server` command line of the deployment `name` (collocated, read, write)."""
    argv = [sys.executable, "-m", "tandem.server", "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(args.server_args)]
    if args.model:
        argv += ["--model", args.model]
    if args.trace:
        argv += ["--log-level", "debug"]
    if name == "collocated":
        return argv + (["--device", f"cuda:{args.gpu}"] if args.gpu is not None else ["--device", args.device])
    argv += ["--role", "disagg", "--kv-mode", name, "--kv-transport", args.kv_transport, "--base-port", "0"]
    if args.gpu is not None:
        return argv + ["--prefill-gpus", str(args.gpu), "--decode-gpus", str(args.gpu)]
    return argv + ["--device", args.device]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy within {timeout_s:.0f} s; log {log}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_config(url: str, args: argparse.Namespace, num_prompts: int, seed: int) -> BenchmarkConfig:
    return BenchmarkConfig(base_url=url, random_input_len=args.prompt_len, random_output_len=args.max_tokens,
                           num_prompts=num_prompts, max_concurrency=1, ignore_eos=True, seed=seed,
                           vocab_size=args.vocab_size, disable_tqdm=True, metric_percentiles=(90.0,))


def trace_stages(log_text: str, sends: list[float]) -> list[dict[str, float]]:
    """Per request (in send order): stage -> ms after its send. One request at a time: a stamp
    belongs to the last request sent before it (the parts name a request differently); a stage
    passed twice counts once, the first time."""
    per_request: list[dict[str, float]] = [{} for _ in sends]
    for stage, _rid, t in _TRACE_RE.findall(log_text):
        i = bisect.bisect_right(sends, float(t)) - 1
        if i >= 0:
            per_request[i].setdefault(stage, (float(t) - sends[i]) * 1e3)
    return per_request


def median_stages(per_request: list[dict[str, float]]) -> dict[str, float]:
    """stage -> its median ms after the send, in order of time."""
    out: dict[str, list[float]] = {}
    for stages in per_request:
        for stage, ms in stages.items():
            out.setdefault(stage, []).append(ms)
    return dict(sorted(((k, statistics.median(v)) for k, v in out.items()), key=lambda kv: kv[1]))


def beyond_prefill(ttft_ms: list[float], per_request: list[dict[str, float]]) -> list[float]:
    """Each request's TTFT less its prefill's compute (the engine's scheduling of the prompt to its
    first token, on the collocated or prefill instance): the overhead, steady on a busy CPU too."""
    out = []
    for ttft, stages in zip(ttft_ms, per_request):
        for side in ("colloc", "prefill"):
            start, end = stages.get(f"{side}.core.scheduled"), stages.get(f"{side}.core.first_token")
            if start is not None and end is not None:
                out.append(ttft - (end - start))
                break
    return out


def measure(name: str, args: argparse.Namespace, log_dir: Path) -> Result:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(deployment_argv(name, args, port), stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
    try:
        t0 = time.monotonic()
        wait_ready(url, proc, log, args.startup_timeout)
        print(f"{name}: up in {time.monotonic() - t0:.0f} s", flush=True)
        asyncio.run(run_benchmark(bench_config(url, args, args.warmup, seed=1000)))
        result = asyncio.run(run_benchmark(bench_config(url, args, args.num_requests, seed=0)))
        # run_benchmark's clock started duration_s before it returned (to within its clean-up, < 1 ms)
        t0 = time.time() - result.duration_s
        done = sorted((r for r in result.records if r.success), key=lambda r: r.start_s)
        if len(done) != len(result.records):
            raise RuntimeError(f"{name}: {len(result.records) - len(done)} requests failed: {result.summary['errors']}")
        ttft = [r.ttft_s * 1e3 for r in done]
        if not args.trace:
            return Result(name, ttft, {}, [])
        time.sleep(0.5)  # let the logs flush
        per_request = trace_stages(log.read_text(errors="replace"), [t0 + r.start_s for r in done])
        return Result(name, ttft, median_stages(per_request), beyond_prefill(ttft, per_request))
    finally:
        stop(proc)


def table(results: list[Result]) -> str:
    base = statistics.median(results[0].ttft_ms)
    traced = all(r.overhead_ms for r in results)
    lines = [f"{'deployment':<12} {'TTFT p50 ms':>11} {'p90 ms':>8} {'p50 - colloc':>13}"
             + (f" {'TTFT-prefill p50':>16} {'- colloc':>9}" if traced else "")]
    base_overhead = statistics.median(results[0].overhead_ms) if traced else 0.0
    for r in results:
        p50 = statistics.median(r.ttft_ms)
        line = f"{r.name:<12} {p50:>11.1f} {percentile(r.ttft_ms, 90):>8.1f} {p50 - base:>+13.1f}"
        if traced:
            overhead = statistics.median(r.overhead_ms)
            line += f" {overhead:>16.1f} {overhead - base_overhead:>+9.1f}"
        lines.append(line)
    for r in results:
        if r.stages:
            lines.append(f"{r.name} stages (median ms after send): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in r.stages.items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    ap.add_argument("--server-args", default="", help="more `server` flags for every deployment (one string)")
    ap.add_argument("--device", default="cpu", help="device without --gpu (cpu)")
    ap.add_argument("--gpu", type=int, default=None, help="GPU id: collocated, prefill and decode all on it")
    ap.add_argument("--kv-transport", default="tcp", help="PD KV transport (tcp, ipc, ...)")
    ap.add_argument("--modes", default="read,write", help="PD modes to measure, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=500, help="prompt tokens (random token ids)")
    ap.add_argument("--max-tokens", type=int, default=2, help="output tokens per request")
    ap.add_argument("--vocab-size", type=int, default=4000, help="random token ids are drawn below this")
    ap.add_argument("--num-requests", type=int, default=20, help="timed requests per deployment (c=1)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed requests first")
    ap.add_argument("--trace", action="store_true", help="log and report per-stage times (DEBUG logs)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a deployment to get healthy")
    ap.add_argument("--log-dir", default="benchmarks/out/pd_ttft", help="the deployments' logs go here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ["collocated"] + [m for m in args.modes.split(",") if m]
    results = [measure(name, args, log_dir) for name in names]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

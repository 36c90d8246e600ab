"""A `--role disagg` tree (router + prefill + decode, API key from a file, pinned ports) under
hostile and heavy load on CPU. References: the server's own OpenAPI schema (schemathesis), OpenAI's
rule that client input never gets a 5xx, and the engines' KV block counts (all free at rest)."""
import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.api_fuzz import fuzz
from tests.e2e.conftest import ENGINE_ARGS, metric, pd_port_args, wait_all_blocks_free
from tests.server.conftest import ServerProcess, pid_alive

pytestmark = pytest.mark.slow
KEY = "pd-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SOAK_SECONDS = 20  # ~300 answered, ~70 refused and ~300 aborted requests on 2 CPU cores: ample for its checks
SOAK_CONCURRENCY = 64
# 64 clients with n up to 3 queue ~130 requests at a decode that runs 16 at a time on 2 shared
# cores: a prefill may wait tens of seconds for its decode's block ids. The connector's default
# timeouts (30 s / 60 s), not the fault tests' 4 s, which would turn queueing into 500s.
SOAK_KV_CONFIG = '{"kv_connector_extra_config": {"transfer_timeout_s": 60, "hold_timeout_s": 60}}'


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


@pytest.fixture(scope="module")
def tree(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-tree")
    key_file = logs / "key"
    key_file.write_text(KEY + "\n")
    port_args, http_ports = pd_port_args()
    proc = ServerProcess(logs / "disagg.log", [
        "--role", "disagg", "--model", str(model_dir), "--served-model-name", "default", *ENGINE_ARGS,
        "--api-key-file", str(key_file), "--shutdown-timeout", "20", *port_args,
        "--kv-transfer-config", SOAK_KV_CONFIG])
    proc.instance_urls = [f"http://127.0.0.1:{port}" for port in http_ports]
    try:
        proc.wait_healthy(240)
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.stop(90)


def test_key_guards_router_and_instances(tree):
    body = {"model": "default", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{tree.url}/v1/completions", json=body).status_code == 401
    for url in tree.instance_urls:  # started by the router's tree: they accept only its key
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        assert httpx.get(f"{url}/health").json()["status"] == "ready"
    assert httpx.post(f"{tree.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert "failed its health check" not in tree.read_log()  # instances register only once serving
    assert KEY not in Path(f"/proc/{tree.proc.pid}/cmdline").read_text()


def test_schemathesis_router(tree):
    """The instances' schema (the router serves the same OpenAI routes, plus upstream errors),
    then the router's own routes."""
    schema = httpx.get(f"{tree.instance_urls[1]}/openapi.json", headers=AUTH).json()
    for op in (schema["paths"]["/v1/completions"]["post"], schema["paths"]["/v1/chat/completions"]["post"]):
        for code in (502, 504):
            op["responses"][str(code)] = op["responses"]["503"]
    calls = fuzz(schema, tree.url, AUTH, max_examples=30, time_budget_s=150, include_path="/v1/")
    own = httpx.get(f"{tree.url}/openapi.json", headers=AUTH).json()
    calls += fuzz(own, tree.url, AUTH, max_examples=10, time_budget_s=30)
    assert calls > 40
    wait_all_blocks_free(tree.instance_urls, 60)


async def _one(client: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    long = rng.random() < 0.1  # over max_model_len: a 400
    words = rng.randint(300, 400) if long else rng.randint(1, 30)
    text = " ".join(rng.choice(["apples", "Tom", "buys", "7", "more", "?"]) for _ in range(words))
    body = {"model": "default", "max_tokens": rng.randint(1, 8), "n": rng.choice([1, 1, 2, 3]),
            "temperature": rng.choice([0, 0.8]), "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    abort_after = rng.choice([None, None, None, 0.05, 0.3, 1.0])  # seconds, then the client hangs up
    try:
        async with asyncio.timeout(abort_after) if abort_after else _null():
            async with client.stream("POST", path, json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                stats[resp.status_code] = stats.get(resp.status_code, 0) + 1
    except (TimeoutError, asyncio.TimeoutError):
        stats["aborted"] = stats.get("aborted", 0) + 1


class _null:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def test_soak_no_5xx_no_leaked_blocks(tree):
    stats: dict = {}

    async def worker(seed: int, deadline: float, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            await _one(client, rng, stats)

    async def main() -> None:
        limits = httpx.Limits(max_connections=SOAK_CONCURRENCY * 2)
        async with httpx.AsyncClient(base_url=tree.url, headers=AUTH, timeout=120, limits=limits) as client:
            deadline = time.monotonic() + SOAK_SECONDS
            await asyncio.gather(*(worker(i, deadline, client) for i in range(SOAK_CONCURRENCY)))

    asyncio.run(main())
    assert not any(isinstance(k, int) and k >= 500 for k in stats), stats
    assert stats.get(200, 0) > 20 and stats.get(400, 0) > 0 and stats.get("aborted", 0) > 0, stats
    wait_all_blocks_free(tree.instance_urls, 60)
    for url in tree.instance_urls:
        assert metric(url, "num_requests_running") == 0


def test_sigterm_drains_in_flight_then_stops_router_first(tree):
    """SIGTERM while a stream runs: the stream still finishes (shutdown timeout 20 s), the router
    stops before the instances, and no process of the tree is left."""
    procs = _descendants(tree.proc.pid)
    body = {"model": "default", "prompt": "Tom has 3 apples", "max_tokens": 24, "stream": True, "ignore_eos": True,
            "temperature": 0}
    events = []
    with httpx.stream("POST", f"{tree.url}/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
        lines = resp.iter_lines()
        events.append(next(l for l in lines if l.startswith("data:")))
        tree.proc.send_signal(signal.SIGTERM)
        events += [l for l in lines if l.startswith("data:")]
    assert events[-1] == "data: [DONE]", events
    last = json.loads(events[-2].removeprefix("data: "))  # (the test once parsed the line with its prefix)
    assert last["choices"][0]["finish_reason"] == "length", events[-3:]
    assert tree.proc.wait(120) == 0, tree.read_log()[-3000:]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in procs), [p for p in procs if pid_alive(p)]
    log = tree.read_log()
    assert log.index("router stopped") < log.index("tandem.server: SIGTERM received; stopping"), log[-3000:]

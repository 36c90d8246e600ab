"""The router -> instance HTTP hop in isolation: how long until the instance's handler holds the
parsed body of a big completions request, per HTTP client, and the router's own parse cost.

A tiny FastAPI app (uvicorn, as an instance runs it) in a child process answers each POST with the
wall time at which its handler had parsed the JSON body; the clients, in this process, post a
`--prompt-len`-token-id completions body one request at a time (keep-alive connections) and the
hop is that time less the time just before the call. Clients:

  direct-aiohttp   aiohttp, json=body (what benchmarks.serve sends: the client -> server hop)
  upstream         the router's Upstream.post_json (router/upstream.py: aiohttp since issue 27)
  httpx-json       an httpx.AsyncClient, json=body (the router's client before issue 27)
  httpx-bytes      the same with pre-encoded bytes
  aiohttp-bytes    aiohttp with pre-encoded bytes

It also times, in-process, the router's parse of the client's body (parse_json_body's json.loads
+ find_invalid_text) and the encode of the body it sends on.

    python -m benchmarks.router_hop --prompt-len 2000 --num-requests 200
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import timeit

import aiohttp
import httpx

from benchmarks.goodput.deployment import free_port

_APP = """
import json, time, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
app = FastAPI()
@app.post("/v1/completions")
async def completions(request: Request):
    body = json.loads(await request.body())
    return JSONResponse({"t": time.time(), "n": len(body["prompt"])})
@app.get("/health")
async def health():
    return {}
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


def completion_body(prompt_len: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"model": "default", "prompt": [rng.randrange(32000) for _ in range(prompt_len)], "max_tokens": 1,
            "temperature": 0.0, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
                                   "remote_port": 1, "remote_notify_port": 2}}


async def _upstream_poster(url: str):
    """Upstream.post_json against a registry-less Instance (the router's real code path)."""
    from tandem.router.config import RouterConfig
    from tandem.router.metrics import RouterMetrics
    from tandem.router.protocol import InstanceInfo
    from tandem.router.registry import Instance, InstanceRegistry
    from tandem.router.upstream import Upstream, make_http_client

    config = RouterConfig()
    client = make_http_client(config.connect_timeout_s, config.request_timeout_s)
    metrics = RouterMetrics()
    upstream = Upstream(client, InstanceRegistry(config, client, metrics), metrics)
    inst = Instance(info=InstanceInfo(instance_id="hop", role="prefill", http_address=url), last_seen=time.time())

    async def post(body: dict) -> dict:
        return await upstream.post_json(inst, "/v1/completions", body, {"X-Request-Id": "hop"})
    return post, client.close if isinstance(client, aiohttp.ClientSession) else client.aclose


async def _clients(url: str):
    session = aiohttp.ClientSession()
    hx = httpx.AsyncClient(trust_env=False, timeout=30)
    target = url + "/v1/completions"

    async def aiohttp_json(body):
        async with session.post(target, json=body) as r:
            return await r.json()

    async def aiohttp_bytes(body):
        async with session.post(target, data=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"}) as r:
            return await r.json()

    async def httpx_json(body):
        return (await hx.post(target, json=body)).json()

    async def httpx_bytes(body):
        return (await hx.post(target, content=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"})).json()

    upstream_post, upstream_close = await _upstream_poster(url)
    clients = {"direct-aiohttp": aiohttp_json, "upstream": upstream_post, "httpx-json": httpx_json,
               "httpx-bytes": httpx_bytes, "aiohttp-bytes": aiohttp_bytes}

    async def close():
        await session.close()
        await hx.aclose()
        await upstream_close()
    return clients, close


async def measure(url: str, body: dict, num_requests: int, warmup: int) -> dict[str, list[float]]:
    clients, close = await _clients(url)
    hops: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for i in range(warmup + num_requests):
            for name, post in clients.items():  # interleaved: drift hits every client alike
                t0 = time.time()
                answer = await post(body)
                if i >= warmup:
                    hops[name].append((answer["t"] - t0) * 1e3)
    finally:
        await close()
    return hops


def parse_cost_ms(body: dict, repeat: int) -> dict[str, float]:
    from tandem.router.text_check import find_invalid_text
    raw = json.dumps(body).encode()
    per = {"router json.loads": lambda: json.loads(raw),
           "router find_invalid_text": lambda: find_invalid_text(body),
           "json.dumps (re-encode)": lambda: json.dumps(body).encode()}
    return {name: min(timeit.repeat(fn, number=1, repeat=repeat)) * 1e3 for name, fn in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=2000, help="token ids in the completions body")
    parser.add_argument("--num-requests", type=int, default=200, help="measured requests per client")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests per client first")
    args = parser.parse_args()
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", _APP.replace("{port}", str(port))])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("hop server did not start")
            time.sleep(0.1)
        body = completion_body(args.prompt_len)
        hops = asyncio.run(measure(url, body, args.num_requests, args.warmup))
    finally:
        child.terminate()
        child.wait(10)
    print(f"send -> handler has the parsed body, {args.prompt_len}-token body "
          f"({len(json.dumps(body))} bytes), {args.num_requests} requests, ms:")
    print(f"{'client':<16} {'median':>7} {'p10':>7} {'p90':>7}")
    for name, ms in hops.items():
        ms = sorted(ms)
        print(f"{name:<16} {statistics.median(ms):7.3f} {ms[len(ms) // 10]:7.3f} {ms[len(ms) * 9 // 10]:7.3f}")
    print("router-side work on the same body (best of 50), ms:")
    for name, ms in parse_cost_ms(body, 50).items():
        print(f"{name:<26} {ms:7.3f}")


if __name__ == "__main__":
    main()

"""PD disaggregation end to end: router + prefill + decode processes over each CPU KV transport
(tcp; nixl when its extra is installed). Reference: the output of a collocated server on the same
model: greedy text under load, and, one request at a time, the very same top_logprobs (float
equality), greedy and seeded sampling.

One prefill and one decode instance per transport serve both modes, each behind a router of its
own --kv-mode, each mode with prompts of its own (a decode finding the other mode's prompts in its
prefix cache would receive only their tails). Scheduling differs by side so that every mode meets
each scheduler on each side: over tcp the prefill schedules asynchronously and the decode
synchronously, over nixl the other way round; 2P2D (write, tcp) runs both asynchronously."""
import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_ARGS, KV_CONFIG, NIXL, Proc, collocated_answers, metric, wait_all_blocks_free
from tests.ports import free_port_range
from tests.server.conftest import stop_all


def prompt_set(name: str, seller: str) -> tuple[list[str], list[tuple]]:
    """(prompts sent under load, exact cases) asking about `name` and `seller`: no prompt of one set
    shares a first KV block with a prompt of another."""
    prompts = [f"Question: {name} has {n} apples and buys {n + 3} more. How many now?\nAnswer:" for n in range(12)]
    prompts += [f"{seller} sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                f"How many clips did {seller} sell altogether in April and May?"] * 2
    long = (f"{seller} sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 3
            + f"How many clips did {seller} sell altogether?")  # several prefill chunks (--max-num-batched-tokens 64)
    exact = [  # (prompt, request fields): each sent alone, compared with collocated exactly
        (prompts[0], dict(max_tokens=12, temperature=0)),
        (long, dict(max_tokens=12, temperature=0)),
        (long, dict(max_tokens=12, temperature=0.8, seed=1234)),
        (prompts[5], dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, stream=True)),
        (prompts[3], dict(max_tokens=1, temperature=0)),  # the decode emits the prefill's token and stops
        (prompts[4], dict(max_tokens=6, temperature=0, extra_body={"min_tokens": 4})),
    ]
    return prompts, exact


SETS = {"read": prompt_set("Tom", "Natalia"), "write": prompt_set("Sam", "Weng")}


def generate(base_url: str, prompts: list[str]) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)

    def one(i: int) -> str:
        kw = dict(model="default", prompt=prompts[i], max_tokens=16, temperature=0)
        if i % 2:  # half of them streamed
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return client.completions.create(**kw).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(len(prompts))))


def generate_exact(base_url: str, cases: list[tuple]) -> list[tuple]:
    """One request at a time (equal batch composition): (text, token logprobs, top_logprobs, usage)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for prompt, kw in cases:
        kw = dict(kw)
        if kw.pop("stream", False):
            chunks = list(client.completions.create(model="default", prompt=prompt, logprobs=2, stream=True,
                                                    stream_options={"include_usage": True}, **kw))
            choice = [c.choices[0] for c in chunks if c.choices]
            out.append(("".join(c.text for c in choice),
                        [x for c in choice if c.logprobs for x in c.logprobs.token_logprobs],
                        [x for c in choice if c.logprobs for x in c.logprobs.top_logprobs],
                        chunks[-1].usage.completion_tokens))
        else:
            r = client.completions.create(model="default", prompt=prompt, logprobs=2, **kw)
            c = r.choices[0]
            out.append((c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs, r.usage.completion_tokens))
    return out


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    """{mode: (texts under load, exact answers)} of a collocated server, the sets in the order the
    pairs serve them."""
    def ask(url: str):
        out = {}
        for mode, (prompts, exact_cases) in SETS.items():
            exact = generate_exact(url, exact_cases)  # first: prefix-cache hits later come from these same runs
            out[mode] = generate(url, prompts), exact
        return out
    return collocated_answers(model_dir, tmp_path_factory.mktemp("colloc"), ask)


def _instance(role: str, name: str, model_dir, registry: int, transport: str, log_dir, *extra: str) -> Proc:
    return Proc(name, ["--role", role, "--model", str(model_dir), "--served-model-name", "default",
                       "--router-address", f"127.0.0.1:{registry}", "--kv-transfer-config", KV_CONFIG,
                       "--kv-transport", transport, *ENGINE_ARGS, *extra], log_dir)


def start_router(registry: int, mode: str, num_instances: int, log_dir, name: str = "router",
                 instance_timeout: float = 5.0) -> Proc:
    """A router of `mode` on `registry`, healthy, with num_instances registered."""
    router = Proc(name, ["--role", "router", "--registry-port", str(registry), "--kv-mode", mode,
                         "--instance-timeout", str(instance_timeout), "--request-timeout", "60"], log_dir)
    try:
        router.wait_healthy(60)
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{router.url}/instances").json().get("instances", [])) < num_instances:
            assert time.monotonic() < deadline, httpx.get(f"{router.url}/instances").text
            time.sleep(0.3)
    except BaseException:
        router.stop()
        raise
    return router


def start_deployment(model_dir, log_dir, mode: str, num_prefill: int = 1, num_decode: int = 1,
                     extra_args: tuple[str, ...] = (), transport: str = "tcp"):
    registry = free_port_range(1)  # each process's other ports come from its own ServerProcess block
    instances = [_instance(role, f"{role}{i}", model_dir, registry, transport, log_dir, *extra_args)
                 for role, n in (("prefill", num_prefill), ("decode", num_decode)) for i in range(n)]
    try:
        for p in instances:
            p.wait_healthy()
        router = start_router(registry, mode, len(instances), log_dir)
    except BaseException:  # one part failed to start: stop the others, not left running after the test
        stop_all(instances)
        raise
    return router, instances


def test_disagg_2p2d_matches_collocated(model_dir, tmp_path, expected):
    """Two prefills and two decodes (write, tcp, async scheduling): requests spread over every
    instance. Spreading is the router's and the connector's scheduler side, the same for every
    transport; nixl's reads and layer-wise writes run in its pair above, and one nixl transport
    serving several peers in tests/connectors/test_nixl.py. (The instances' prefix caches hit
    differently than collocated's: greedy text under load only.)"""
    router, instances = start_deployment(model_dir, tmp_path, "write", 2, 2, extra_args=("--async-scheduling",))
    prompts, _ = SETS["write"]
    try:
        assert generate(router.url, prompts) == expected["write"][0]
        decodes = [p for p in instances if p.name.startswith("decode")]
        prefills = [p for p in instances if p.name.startswith("prefill")]
        assert sum(metric(d.url, "num_remote_prefills") for d in decodes) >= len(prompts) - 1
        assert all(metric(p.url, "prompt_tokens_total") > 0 for p in prefills)
        wait_all_blocks_free([p.url for p in instances])
    finally:
        stop_all([router, *instances])


# transport -> (prefill's, decode's) scheduling flag
PAIRS = {"tcp": ("--async-scheduling", "--no-async-scheduling"),
         "nixl": ("--no-async-scheduling", "--async-scheduling")}


@pytest.fixture(scope="module")
def pair(request, model_dir, tmp_path_factory):
    """(registry port, prefill, decode, log dir) of request.param's transport, shared by both modes."""
    transport = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{transport}")
    registry = free_port_range(1)
    p_flag, d_flag = PAIRS[transport]
    instances = [_instance("prefill", "prefill0", model_dir, registry, transport, log_dir, p_flag),
                 _instance("decode", "decode0", model_dir, registry, transport, log_dir, d_flag)]
    try:
        for p in instances:
            p.wait_healthy()
        yield registry, *instances, log_dir
    finally:
        stop_all(instances)


@pytest.mark.parametrize("pair", ["tcp", pytest.param("nixl", marks=NIXL)], indirect=True)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_disagg_matches_collocated(pair, expected, mode):
    registry, prefill, decode, log_dir = pair
    expected_texts, expected_exact = expected[mode]
    prompts, exact_cases = SETS[mode]
    remote_prefills = metric(decode.url, "num_remote_prefills")  # (the other mode's, if it ran first)
    router = start_router(registry, mode, 2, log_dir, name=f"router-{mode}")
    try:
        for got, want in zip(generate_exact(router.url, exact_cases), expected_exact):
            assert got == want  # float equality of every logprob
        assert generate(router.url, prompts) == expected_texts
        # Every decode request but the ones whose prompt is a single block got its KV remotely.
        assert metric(decode.url, "num_remote_prefills") - remote_prefills >= len(prompts) - 1
        # ... and its wait for that KV is in the decode's phase metrics (the prefill never waits)
        assert metric(decode.url, "request_kv_transfer_wait_time_seconds_count") >= len(prompts) - 1
        assert metric(prefill.url, "request_kv_transfer_wait_time_seconds_count") == 0
        assert metric(prefill.url, "request_prefill_time_seconds_count") >= len(prompts)
        wait_all_blocks_free([prefill.url, decode.url])
    finally:
        router.stop()

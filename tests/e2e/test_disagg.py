"""PD disaggregation end to end: router + prefill + decode processes over each CPU KV transport
(tcp; nixl when its extra is installed). Reference: the output of a collocated server on the same
model: greedy text under load, and, one request at a time, the very same top_logprobs (float
equality), greedy and seeded sampling."""
import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_ARGS, KV_CONFIG, NIXL, Proc, collocated_answers, metric, wait_all_blocks_free
from tests.ports import free_port_range
from tests.server.conftest import stop_all

PROMPTS = [f"Question: Tom has {n} apples and buys {n + 3} more. How many now?\nAnswer:" for n in range(12)]
PROMPTS += ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?"] * 2


def generate(base_url: str, prompts: list[str]) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)

    def one(i: int) -> str:
        kw = dict(model="default", prompt=prompts[i], max_tokens=16, temperature=0)
        if i % 2:  # half of them streamed
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return client.completions.create(**kw).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(len(prompts))))


LONG = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 3
        + "How many clips did Natalia sell altogether?")  # several prefill chunks (--max-num-batched-tokens 64)
EXACT_CASES = [  # (prompt, request fields): each sent alone, compared with collocated exactly
    (PROMPTS[0], dict(max_tokens=12, temperature=0)),
    (LONG, dict(max_tokens=12, temperature=0)),
    (LONG, dict(max_tokens=12, temperature=0.8, seed=1234)),
    (PROMPTS[5], dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, stream=True)),
    (PROMPTS[3], dict(max_tokens=1, temperature=0)),  # the decode emits the prefill's token and stops
    (PROMPTS[4], dict(max_tokens=6, temperature=0, extra_body={"min_tokens": 4})),
]


def generate_exact(base_url: str) -> list[tuple]:
    """One request at a time (equal batch composition): (text, token logprobs, top_logprobs, usage)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for prompt, kw in EXACT_CASES:
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
    def ask(url: str):
        exact = generate_exact(url)  # first: prefix-cache hits later come from these same runs
        return generate(url, PROMPTS), exact
    return collocated_answers(model_dir, tmp_path_factory.mktemp("colloc"), ask)


def start_deployment(model_dir, log_dir, mode: str, num_prefill: int = 1, num_decode: int = 1,
                     instance_timeout: float = 5.0, extra_args: tuple[str, ...] = (), transport: str = "tcp"):
    registry = free_port_range(1)  # each process's other ports come from its own ServerProcess block
    router = Proc("router", ["--role", "router", "--registry-port", str(registry), "--kv-mode", mode,
                             "--instance-timeout", str(instance_timeout), "--request-timeout", "60"], log_dir)
    router_reg = f"127.0.0.1:{registry}"
    instances = []
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(n):
            instances.append(Proc(f"{role}{i}", ["--role", role, "--model", str(model_dir), "--served-model-name",
                                                  "default", "--router-address", router_reg,
                                                  "--kv-transfer-config", KV_CONFIG, "--kv-transport", transport,
                                                  *ENGINE_ARGS, *extra_args],
                                  log_dir))
    try:
        for p in instances:
            p.wait_healthy()
        router.wait_healthy(60)
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{router.url}/instances").json().get("instances", [])) < len(instances):
            assert time.monotonic() < deadline, httpx.get(f"{router.url}/instances").text
            time.sleep(0.3)
    except BaseException:  # one part failed to start: stop the others, not left running after the test
        stop_all([router, *instances])
        raise
    return router, instances


TOPOLOGIES = [("read", 1, 1, True), ("write", 1, 1, False), ("write", 2, 2, True)]  # mode, P, D, async scheduling
# 2P2D over tcp only: spreading requests over several instances is the router's and the connector's
# scheduler side, the same for every transport; nixl's reads and layer-wise writes run in its 1P1D
# cases, and one nixl transport serving several peers in tests/connectors/test_nixl.py.
CASES = [pytest.param(*topo, "tcp", id="-".join(map(str, (*topo, "tcp")))) for topo in TOPOLOGIES] + [
    pytest.param(*topo, "nixl", marks=NIXL, id="-".join(map(str, (*topo, "nixl")))) for topo in TOPOLOGIES
    if topo[1:3] == (1, 1)]


@pytest.mark.parametrize("mode,num_p,num_d,async_scheduling,transport", CASES)
def test_disagg_matches_collocated(model_dir, tmp_path, expected, mode, num_p, num_d, async_scheduling, transport):
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    router, instances = start_deployment(model_dir, tmp_path, mode, num_p, num_d, extra_args=(flag,),
                                         transport=transport)
    expected_texts, expected_exact = expected
    try:
        if num_p == num_d == 1:  # (more instances: their prefix caches hit differently than collocated's)
            for got, want in zip(generate_exact(router.url), expected_exact):
                assert got == want  # float equality of every logprob
        assert generate(router.url, PROMPTS) == expected_texts
        decodes = [p for p in instances if p.name.startswith("decode")]
        prefills = [p for p in instances if p.name.startswith("prefill")]
        # Every decode request but the ones whose prompt is a single block got its KV remotely.
        assert sum(metric(d.url, "num_remote_prefills") for d in decodes) >= len(PROMPTS) - 1
        if num_p > 1:
            assert all(metric(p.url, "prompt_tokens_total") > 0 for p in prefills)
        wait_all_blocks_free([p.url for p in instances])
    finally:
        stop_all([router, *instances])

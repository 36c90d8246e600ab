"""The OpenAI API of a real `python -m tandem.server` on the tiny Llama. References: transformers'
forward pass on the same weights (logprobs within 1e-4, greedy tokens equal), the
non-streaming response (for streams), and OpenAI's error JSON shape."""
import json
import re
import socket
import time

import httpx
import openai
import pytest
import torch

from conftest import MAX_MODEL_LEN

PROMPT = "Natalia sold clips to 48 of her friends in April"


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of the HF model's logits."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Argmax decoding over the full vocabulary (EOS included, never stopping: ignore_eos)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf_model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def metric(http, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_all_blocks_free(http, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free, total = metric(http, "tandem:kv_cache_free_blocks"), metric(http, "tandem:kv_cache_total_blocks")
        if free == total and metric(http, "tandem:num_requests_running") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks not all free after {timeout}s: {free}/{total}")


# ---- basics ------------------------------------------------------------------------------

def test_models_health_version(client, http, tiny_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_model_dir.name]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


NO_EOS = {"extra_body": {"ignore_eos": True}}


def test_completion_string_batch_and_token_ids(client, tokenizer):
    one = client.completions.create(model="default", prompt=PROMPT, max_tokens=5, temperature=0, **NO_EOS)
    assert len(one.choices) == 1 and one.choices[0].finish_reason == "length"
    assert one.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and one.usage.completion_tokens == 5
    batch = client.completions.create(model="default", prompt=[PROMPT, "Weng earns"], max_tokens=5, temperature=0,
                                      **NO_EOS)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=5, temperature=0, **NO_EOS)
    assert by_ids.choices[0].text == one.choices[0].text
    by_id_lists = client.completions.create(model="default", prompt=[ids, ids[:4]], max_tokens=5, temperature=0,
                                             **NO_EOS)
    assert by_id_lists.choices[0].text == one.choices[0].text and len(by_id_lists.choices) == 2


def test_greedy_tokens_and_logprobs_match_transformers(client, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    n = 12
    expected = hf_greedy(hf_model, ids, n)
    out = client.completions.create(model="default", prompt=ids, max_tokens=n, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": False})
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(expected)
    ref = hf_logprobs(hf_model, ids + expected)
    for i, (tok, lp) in enumerate(zip(expected, choice.logprobs.token_logprobs)):
        assert lp == pytest.approx(ref[len(ids) - 1 + i, tok].item(), abs=1e-4)
        top3 = ref[len(ids) - 1 + i].topk(3).values.tolist()
        for value in choice.logprobs.top_logprobs[i].values():  # tokens with one string share a key
            assert min(abs(value - v) for v in top3) < 1e-4
        assert max(choice.logprobs.top_logprobs[i].values()) == pytest.approx(lp, abs=1e-6)  # greedy = top-1


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_prompt_logprobs_match_transformers(client, tokenizer, hf_model, max_tokens):
    """lm-eval local-completions loglikelihood: echo + logprobs + max_tokens 0 (or 1)."""
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model="default", prompt=[ids], max_tokens=max_tokens, echo=True, logprobs=1,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.choices[0].text.startswith(tokenizer.decode(ids))
    ref = hf_logprobs(hf_model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.completion_tokens == max_tokens


def test_completion_stream_with_usage_equals_non_stream(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=10, temperature=0, **NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


# ---- chat --------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "How many clips did Natalia sell?"}]


def test_chat_and_chat_stream(client, tokenizer):
    out = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and out.choices[0].finish_reason in ("length", "stop")
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt_ids, add_special_tokens=False))
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with_max_completion = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0,
                                                         max_completion_tokens=3)
    assert with_max_completion.usage.completion_tokens <= 3


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert bytes(item.bytes).decode(errors="replace") == item.token


# ---- sampling ----------------------------------------------------------------------------

def test_n_and_seeded_sampling(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234, n=3, **NO_EOS)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the n samples differ from each other
    assert a.usage.completion_tokens == 24
    single = client.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].text == a.choices[0].text
    chat = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5, n=2, seed=7,
                                          temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]
    streamed = list(client.completions.create(**kwargs, stream=True))
    by_index = {}
    for c in streamed:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert [by_index[i] for i in range(3)] == [c.text for c in a.choices]


def test_stop_strings_and_stop_token_ids(client, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    greedy = hf_greedy(hf_model, ids, 16)
    full = tokenizer.decode(greedy, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    kwargs = dict(model="default", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs, stop=[stop, "never-there"])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == out.choices[0].text
    k = 5
    by_token = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                    "stop_token_ids": [greedy[k]]}})
    first = greedy.index(greedy[k])
    assert by_token.choices[0].finish_reason == "stop"
    assert by_token.choices[0].text == tokenizer.decode(greedy[:first], skip_special_tokens=True)
    assert by_token.usage.completion_tokens == first + 1


# ---- errors: each followed by a good request ---------------------------------------------

def _good(client):
    assert client.completions.create(model="default", prompt="ok", max_tokens=2).choices


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "temperature": -0.5},
    {"prompt": "hi", "top_p": 1.5},
    {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "logprobs": 50},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "max_tokens": MAX_MODEL_LEN},
    {"prompt": [1] * (MAX_MODEL_LEN + 1), "max_tokens": 1},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": [1, 2, 10 ** 6]},
    {"prompt": [1, 2, -3]},
    {"prompt": "hi", "max_tokens": "ten"},
    {"prompt": {"not": "a prompt"}},
    {"prompt": "hi", "stop": 5},
    {"prompt": "hi", "seed": 1 << 70},
    {"prompt": "hi", "stop_token_ids": [1 << 40]},
    {"prompt": "hi", "min_tokens": 5, "max_tokens": 2},
    {"prompt": "hi", "echo": True, "max_tokens": -1},
])
def test_completion_errors_are_400(client, http, body):
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    _good(client)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {"messages": MESSAGES, "top_logprobs": 3},
    {"messages": MESSAGES, "max_completion_tokens": -2},
])  # an unknown model is a 404 (test_server_hardening.py)
def test_chat_errors_are_400(client, http, body):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]
    _good(client)


def test_malformed_json_unknown_route_and_openai_client_errors(client, http):
    resp = http.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = http.get("/v1/does-not-exist")
    assert resp.status_code == 404 and resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=-3)
    _good(client)


def test_api_key(server, client):
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}).status_code == 401
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    _good(client)


# ---- disconnects and metrics -------------------------------------------------------------

def test_client_disconnect_mid_stream_frees_blocks(server, http, client):
    wait_all_blocks_free(http)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer test-key"}, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert metric(http, "tandem:num_requests_running") == 1
    wait_all_blocks_free(http)
    _good(client)


def test_client_disconnect_non_streaming_frees_blocks(server, http, client):
    wait_all_blocks_free(http)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}).encode()
    # A raw connection, closed once the engine runs the request: no timing assumptions.
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer test-key\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while metric(http, "tandem:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    sock.close()
    wait_all_blocks_free(http)
    text = http.get("/metrics").text
    assert re.search(r'tandem:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', text)
    _good(client)


def test_metrics_exposes_latency_histograms_and_counters(http, client):
    _good(client)
    text = http.get("/metrics").text
    for name in ["tandem:time_to_first_token_seconds_bucket", "tandem:time_per_output_token_seconds_bucket",
                 "tandem:inter_token_latency_seconds_bucket", "tandem:e2e_request_latency_seconds_bucket",
                 "tandem:prompt_tokens_total", "tandem:generation_tokens_total", "tandem:num_requests_waiting",
                 "tandem:kv_cache_usage_perc", 'finished_reason="length"']:
        assert name in text, name
    assert metric(http, "tandem:generation_tokens_total") > 0
    # the engine's phases of each finished request (vLLM's request_*_time_seconds); no PD here
    for phase in ("queue", "prefill", "decode", "inference"):
        assert metric(http, f"tandem:request_{phase}_time_seconds_count") >= 1, phase
    assert metric(http, "tandem:request_inference_time_seconds_sum") > 0
    assert metric(http, "tandem:request_kv_transfer_wait_time_seconds_count") == 0


def test_concurrent_requests_under_preemption_all_complete(server, http):
    """More work than KV blocks (64): the engine preempts; every request still finishes whole
    and every block comes back."""
    import asyncio

    async def run() -> list:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=120)

        async def one(i: int):
            kwargs = {"model": "default", "prompt": f"Question {i}: Natalia sold", "max_tokens": 60,
                      "extra_body": {"ignore_eos": True}}
            if i % 3 == 0:
                chunks = [ch async for ch in await c.completions.create(**kwargs, stream=True,
                                                                         stream_options={"include_usage": True})]
                return chunks[-1].usage.completion_tokens
            return (await c.completions.create(**kwargs, n=2, seed=i)).usage.completion_tokens

        return await asyncio.gather(*[one(i) for i in range(12)])

    assert asyncio.run(run()) == [60 if i % 3 == 0 else 120 for i in range(12)]
    wait_all_blocks_free(http)

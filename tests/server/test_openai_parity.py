"""OpenAI-parity features end to end: the official `openai` client against a real `server`
process on the default model (engine/default_model). References: jsonschema / re.fullmatch /
set membership of every output; the non-streamed response for streams; the output of an
unconstrained request alone for one batched with constrained ones; the HF tokenizer."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Natalia sold clips to 48 of her friends. How many?"}]
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 999},
    "unit": {"enum": ["clips", "friends"]},
    "checks": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                         "required": ["ok"]}}},
    "required": ["answer", "unit", "checks"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("parity") / "parity.log", [
        "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "128",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", "tiny", "alias"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0, timeout=300)


def _stream_text(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


def test_served_names(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny", "alias"]
    assert oai.completions.create(model="alias", prompt="1+1=", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_chat(oai, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=160, temperature=1.0, seed=5, n=2, response_format=fmt)
    if stream:
        texts = list(_stream_text(oai.chat.completions.create(stream=True, **kw)).values())
    else:
        texts = [c.message.content for c in oai.chat.completions.create(**kw).choices]
    assert len(texts) == 2
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_completions(oai, stream):
    pattern, choices = r"[0-9]{2}-(yes|no)", ["forty-eight", "twelve"]
    for extra, check in [({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
                         ({"structured_outputs": {"choice": choices}}, lambda t: t in choices)]:
        kw = dict(model="tiny", prompt="Q: How many clips? A:", max_tokens=16, n=2, temperature=1.0, seed=1,
                  extra_body=extra)
        if stream:
            texts = list(_stream_text(oai.completions.create(stream=True, **kw)).values())
        else:
            texts = [c.text for c in oai.completions.create(**kw).choices]
        assert len(texts) == 2 and all(check(t) for t in texts), texts


def test_json_object(oai, tokenizer_default):
    # A weak model writes essays inside strings; nudging the closing tokens lets it finish.
    closers = {str(i): 8 for i in range(len(tokenizer_default)) if tokenizer_default.decode([i]).strip() in '"}]'
               and tokenizer_default.decode([i]).strip()}
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96, temperature=1.0, seed=3, n=4,
                                      response_format={"type": "json_object"}, logit_bias=closers)
    for c in out.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_constrained_and_free_requests_in_one_batch(oai):
    free = dict(model="tiny", prompt="Natalia sold clips", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    alone = oai.completions.create(**free).choices[0].text
    constrained = dict(model="tiny", messages=MESSAGES, max_tokens=160, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(oai.chat.completions.create, **constrained) for _ in range(3)]
        frees = [pool.submit(oai.completions.create, **free) for _ in range(3)]
        for job in jobs:
            jsonschema.validate(json.loads(job.result().choices[0].message.content), SCHEMA)
        assert [f.result().choices[0].text for f in frees] == [alone] * 3


def _assembled_tool_calls(stream) -> list[tuple[str, str]]:
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_returns_valid_calls(oai, choice):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0, tools=[WEATHER], tool_choice=choice,
              parallel_tool_calls=False)
    out = oai.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    assert _assembled_tool_calls(oai.chat.completions.create(stream=True, **kw)) == calls


def test_tool_history_and_auto_choice(oai):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = oai.chat.completions.create(model="tiny", messages=history, max_tokens=8, tools=[WEATHER])
    assert out.choices[0].message.content is not None  # hermes finds no <tool_call> in this model's text


def _greedy_tokens(oai, logit_bias: dict | None = None, n: int = 6) -> list[str]:
    out = oai.completions.create(model="tiny", prompt="Natalia sold clips", max_tokens=n, temperature=0, logprobs=0,
                                 logit_bias=logit_bias, extra_body={"ignore_eos": True})
    return out.choices[0].logprobs.tokens


def test_logit_bias(oai, tokenizer_default):
    base = _greedy_tokens(oai)
    banned = _ids_of(oai, "".join(base))
    avoided = _greedy_tokens(oai, {str(t): -100 for t in banned})
    assert not set(avoided) & {tokenizer_default.decode([t]) for t in banned}
    assert _greedy_tokens(oai, {"77": 100}, 3) == [tokenizer_default.decode([77])] * 3


def _ids_of(oai, text: str) -> list[int]:
    return oai.post("/../tokenize", body={"prompt": text, "add_special_tokens": False}, cast_to=object)["tokens"]


def test_tokenize_detokenize(oai, tokenizer_default):
    out = oai.post("/../tokenize", body={"prompt": "hello world", "return_token_strs": True}, cast_to=object)
    assert out["tokens"] == tokenizer_default.encode("hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and "".join(out["token_strs"]) == "hello world"
    chat = oai.post("/../tokenize", body={"messages": MESSAGES}, cast_to=object)
    text = tokenizer_default.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer_default.encode(text, add_special_tokens=False)
    assert oai.post("/../detokenize", body={"tokens": out["tokens"]}, cast_to=object) == {"prompt": "hello world"}


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "guided_regex"),
    ({"extra_body": {"audio": {"voice": "alloy"}}}, "audio"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
])
def test_bad_requests_are_400_naming_the_field(oai, extra, param):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**kw)
    assert err.value.body["param"] == param, err.value.body


@pytest.fixture(scope="module")
def tokenizer_default():
    from transformers import AutoTokenizer

    from tandem.engine.config import DEFAULT_MODEL_DIR
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)

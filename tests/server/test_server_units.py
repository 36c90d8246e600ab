"""In-process tests of the API side: incremental detokenizer (reference: a full decode), error
JSON (reference: OpenAI's error shape), and the app's error paths over a fake engine client."""
import asyncio


import httpx
import msgspec
import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.protocol import RequestOutput, SchedulerStats
from tandem.server.api import build_app
from tandem.server.detokenizer import IncrementalDetokenizer
from tandem.server.engine_client import EngineInfo, RequestStream
from tandem.server.errors import APIError
from tandem.server.tokenizer import Tokenizer

TEXT = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May. Natalia sold 48+24 = 72 clips — "
        "café, naïve, 日本語 and emoji 🙂 included.")


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def _stream_text(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, list[str]]:
    chunks = []
    for t in ids:
        stopped = detok.add_token(t)
        chunks.append(detok.take_text(stopped))
        if stopped:
            break
    detok.finish()
    chunks.append(detok.take_text(True))
    return "".join(chunks), chunks


def test_incremental_text_equals_full_decode(tok):
    prompt = tok.encode("Question: how many clips?")
    ids = tok.encode(TEXT, add_special_tokens=False)
    text, chunks = _stream_text(IncrementalDetokenizer(tok, prompt), ids)
    assert text == tok.decode(ids) == TEXT
    assert not any("\ufffd" in c for c in chunks)


def test_stop_string_cuts_and_is_never_streamed(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    for stop in ["clips in", "=", "日本", "🙂", "May. Nat"]:
        detok = IncrementalDetokenizer(tok, [], [stop, "never-there"])
        text, chunks = _stream_text(detok, ids)
        assert text == TEXT[:TEXT.index(stop)], stop
        assert detok.stop_reason == stop
        assert stop not in "".join(chunks)


def test_incomplete_utf8_at_the_end_is_flushed(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]
    assert tok.decode(ids).endswith("\ufffd")
    assert _stream_text(IncrementalDetokenizer(tok, []), ids)[0] == tok.decode(ids)


def test_skip_special_tokens(tok):
    ids = tok.encode("hello", add_special_tokens=False) + [tok.hf.eos_token_id]
    assert _stream_text(IncrementalDetokenizer(tok, [], skip_special_tokens=True), ids)[0] == "hello"
    assert _stream_text(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids)[0] == "hello</s>"


class FakeEngineClient:
    """Answers each request with a scripted list of outputs (or an exception)."""

    def __init__(self):
        self.info = EngineInfo(max_model_len=64, vocab_size=512, eos_token_ids=[2], tokenizer_path="")
        self.procs = []
        self.dead = False
        self.script = None  # request_id -> list[RequestOutput | Exception]
        self.aborted = []

    async def start_output_loop(self):
        pass

    async def stop_output_loop(self):
        pass

    async def get_stats(self):
        return SchedulerStats(num_free_blocks=7, num_total_blocks=8)

    def add_requests(self, requests):
        stream = RequestStream(self, [r.request_id for r in requests])
        for r in requests:
            for item in self.script(r):
                stream._queue.put_nowait(item)
        return stream

    def abort(self, ids):
        self.aborted += ids


@pytest.fixture(scope="module")
def fake_app(tok, tiny_model_dir):
    fake = FakeEngineClient()
    fake.info.tokenizer_path = tok.path
    app = build_app(fake, EngineConfig.create(model=str(tiny_model_dir)), tok)
    return app, fake


def _post(app, path, body):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post(path, json=body) if body is not None else await c.get(path)
    return asyncio.run(go())


def _ok_script(req):
    return [RequestOutput(req.request_id, [5, 6], finished=True, finish_reason="length", num_prompt_tokens=3)]


def _assert_openai_error(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_engine_error_on_one_request_is_500_then_server_keeps_serving(fake_app):
    app, fake = fake_app
    fake.script = lambda r: [RequestOutput(r.request_id, finished=True, finish_reason="error", error="boom")]
    _assert_openai_error(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 500)
    fake.script = lambda r: [APIError("engine says no", status=400)]
    _assert_openai_error(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 400)
    fake.script = _ok_script
    ok = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_validation_and_routing_errors_are_openai_json(fake_app):
    app, fake = fake_app
    fake.script = _ok_script
    _assert_openai_error(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}), 400)
    _assert_openai_error(_post(app, "/v1/completions", {"max_tokens": 3}), 400)
    _assert_openai_error(_post(app, "/v1/nope", {}), 404)
    _assert_openai_error(_post(app, "/v1/completions", None), 405)
    assert _post(app, "/health", None).status_code == 200
    fake.dead = True
    _assert_openai_error(_post(app, "/health", None), 503)
    fake.dead = False


def test_kv_transfer_params_pass_through(fake_app):
    app, fake = fake_app
    seen = []

    def script(req):
        seen.append(req.kv_transfer_params)
        return [RequestOutput(req.request_id, [5], finished=True, finish_reason="length",
                              kv_transfer_params={"remote_block_ids": [1, 2]})]

    fake.script = script
    params = {"do_remote_decode": True}
    resp = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params})
    assert resp.status_code == 200 and [msgspec.to_builtins(p) for p in seen] == [params]
    assert resp.json()["kv_transfer_params"] == {"remote_block_ids": [1, 2]}
    resp = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "kv_transfer_params": params})
    assert resp.status_code == 200 and resp.json()["kv_transfer_params"] == {"remote_block_ids": [1, 2]}


@pytest.mark.parametrize("params,field", [
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": "x"}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 5}, "remote_block_ids"),
    ({"mode": "push"}, "kv_transfer_params.mode"),
    ([1, 2], "kv_transfer_params"),
])
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(fake_app, params, field):
    app, _ = fake_app
    resp = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert field in err["message"] and err["param"] == "kv_transfer_params"


def test_api_key_guards_every_route_that_takes_client_text(tok, tiny_model_dir):
    """Reference: server/auth.py's contract (README, "API key"): only /health, /metrics and /version are
    open without the key; everything reading client text or describing the API is 401 without it."""
    fake = FakeEngineClient()
    fake.info.tokenizer_path = tok.path
    app = build_app(fake, EngineConfig.create(model=str(tiny_model_dir)), tok, "sekret")

    def call(method, path, key=None):
        async def go():
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                return await c.request(method, path, headers=headers,
                                       json={"prompt": "hi", "tokens": [5]} if method == "POST" else None)
        return asyncio.run(go())

    guarded = [("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
               ("GET", "/openapi.json"), ("GET", "/docs")]
    for method, path in guarded:
        _assert_openai_error(call(method, path), 401)
        _assert_openai_error(call(method, path, key="wrong"), 401)
        assert call(method, path, key="sekret").status_code != 401, path
    for path in ("/health", "/metrics", "/version"):
        assert call("GET", path).status_code != 401, path

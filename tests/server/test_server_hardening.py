"""Hostile and odd client input against a real server: always an OpenAI error JSON with a 4xx,
never a 5xx, and the connection stays usable (reference: OpenAI's error shape and statuses)."""
import httpx
import pytest

from conftest import API_KEY

RAW_BODIES = [  # JSON text as an attacker would send it, escapes and all
    '{"prompt": "hi \\ud800 there", "max_tokens": 2}',
    '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}',
    '{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud83d"]}',
    '{"prompt": "hi", "max_tokens": 2, "model": "\\ud800"}',
    '{"prompt": "hi", "max_tokens": 2, "user": "\\ud800"}',
    '{"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"\\ud800": 1}}',
    '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
    '{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}',
    '{"prompt": "hi", "max_tokens": 2, "temperature": 1e400}',
    '{"prompt": "hi", "max_tokens": 1e400}',
    '[' * 5000 + ']' * 5000,
    '{"prompt": ' + '[' * 200 + '1' + ']' * 200 + '}',
    '{"prompt": "hi", "max_tokens": 2, "kv_transfer_params": ' + '{"a": ' * 100 + '1' + '}' * 100 + '}',
    '{"prompt": "hi"',
    '',
]
CHAT_BODIES = [
    '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}], "max_tokens": 2}',
    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"x": "\\ud800"}}',
]


def _post_raw(http, path: str, raw: bytes | str) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def _assert_client_error(resp: httpx.Response, status: int = 400) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.mark.parametrize("raw", RAW_BODIES)
def test_hostile_completion_bodies_are_400_and_connection_survives(http, raw):
    _assert_client_error(_post_raw(http, "/v1/completions", raw))
    # same keep-alive connection: the next request is served
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("raw", CHAT_BODIES)
def test_hostile_chat_bodies_are_400(http, raw):
    _assert_client_error(_post_raw(http, "/v1/chat/completions", raw))


def test_invalid_utf8_bytes_are_400(http):
    _assert_client_error(_post_raw(http, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'))


def test_surrogate_pair_is_fine(http):
    """A correctly escaped pair is one code point (U+1F600), not an error."""
    resp = _post_raw(http, "/v1/completions", '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}')
    assert resp.status_code == 200, resp.text


def test_unknown_model_is_404_model_not_found(http):
    resp = http.post("/v1/completions", json={"prompt": "hi", "model": "no-such-model"})
    _assert_client_error(resp, 404)
    assert resp.json()["error"]["code"] == "model_not_found"
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "model": "no-such-model"})
    _assert_client_error(resp, 404)


def test_health_is_small_json(server, tiny_model_dir):
    resp = httpx.get(f"{server.url}/health")  # no key: open
    assert resp.status_code == 200
    assert resp.json() == {"status": "ready", "role": "collocated", "model": tiny_model_dir.name}


def test_api_key_guards_v1_and_docs_not_health_metrics(server):
    for path in ("/v1/models", "/docs", "/redoc", "/openapi.json"):
        _assert_client_error(httpx.get(f"{server.url}{path}"), 401)
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, path
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_openapi_documents_400_not_422(http):
    schema = http.get("/openapi.json").json()
    op = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in op and {"400", "401", "404", "503"} <= set(op)

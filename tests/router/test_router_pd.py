"""PD orchestration against fake instances. Reference: the read/write-mode contract in
router/orchestrator.py's docstring (what the engine's KV connector implements)."""
import json
import threading

import httpx
import pytest

from tests.router.router_fakes import STREAM_TEXTS, wait_for

COMPLETION = {"model": "fake-model", "prompt": "Say hello", "max_tokens": 16, "temperature": 0.0}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
        "stream": True, "stream_options": {"include_usage": True}}


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("pd_router", ["read"], indirect=True)
def test_read_mode_prefill_first_then_decode_with_prefill_params(pd_router):
    resp = pd_router.client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "req-42"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["served_by"] == "d0"
    assert resp.headers["x-request-id"] == "req-42"

    (p_req,), (d_req,) = pd_router.prefill.received, pd_router.decode.received
    p_body, d_body = p_req["body"], d_req["body"]
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    # P learns which decode will read (so it can free its blocks at once if that decode dies).
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"]["remote_engine_id"] == pd_router.decode.engine_id
    assert p_body["prompt"] == COMPLETION["prompt"]
    # D gets the client's body unchanged plus exactly what P returned.
    expected_kv = {"remote_engine_id": "engine-p0", "remote_block_ids": [3, 4, 5], "remote_host": "127.0.0.1",
                   "remote_port": pd_router.prefill.kv_port, "remote_request_id": "req-42"}
    assert d_body == {**COMPLETION, "kv_transfer_params": expected_kv}
    assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"] == "req-42"


@pytest.mark.parametrize("pd_router", ["read"], indirect=True)
def test_read_mode_chat_streaming_relays_chunks(pd_router):
    resp = pd_router.client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == STREAM_TEXTS

    p_body = pd_router.prefill.bodies()[0]
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body
    d_body = pd_router.decode.bodies()[0]
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert d_body["max_tokens"] == 16 and d_body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"


def test_streaming_relay_keeps_chunk_boundaries(pd_router):
    pd_router.decode.chunk_delay_s = 0.05
    with pd_router.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = [c.decode() for c in resp.iter_raw()]
    # One upstream SSE event per relayed chunk (the decode instance pauses between events).
    assert len(chunks) == len(STREAM_TEXTS) + 1
    assert [json.loads(sse_events(c)[0])["choices"][0]["text"] for c in chunks[:-1]] == STREAM_TEXTS
    assert chunks[-1] == "data: [DONE]\n\n"


def test_write_mode_reaches_both_with_matching_transfer(pd_router):
    resp = pd_router.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status_code == 200
    assert sse_events(resp.text)[-1] == "[DONE]"

    p, d = pd_router.prefill, pd_router.decode
    # the relay of D's stream may end before P's request reached the fake (P is awaited only after)
    wait_for(lambda: p.received, 5, "prefill's request recorded")
    p_body, d_body = p.bodies()[0], d.bodies()[0]
    p_kv, d_kv = p_body["kv_transfer_params"], d_body["kv_transfer_params"]
    assert len(p_kv["transfer_id"]) == 32 and p_kv["transfer_id"] == d_kv["transfer_id"]
    assert d_kv == {"do_remote_prefill": True, "mode": "write", "transfer_id": p_kv["transfer_id"],
                    "remote_engine_id": "engine-p0", "remote_host": "127.0.0.1",
                    "remote_port": p.kv_port, "remote_notify_port": p.kv_port + 1}
    assert p_kv == {"do_remote_decode": True, "mode": "write", "transfer_id": d_kv["transfer_id"],
                    "remote_engine_id": "engine-d0", "remote_host": "127.0.0.1",
                    "remote_port": d.kv_port, "remote_notify_port": d.kv_port + 1}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == {**COMPLETION, "stream": True}
    assert p.received[0]["headers"]["x-request-id"] == d.received[0]["headers"]["x-request-id"]


def test_write_mode_dispatches_concurrently(pd_router):
    # P is slow: D must already have the request while P is still prefilling.
    pd_router.prefill.delay_s = 1.0
    with httpx.Client(base_url=pd_router.server.url, timeout=10, trust_env=False) as client:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=client.post("/v1/completions", json=COMPLETION)))
        thread.start()
        wait_for(lambda: pd_router.decode.received and pd_router.prefill.received, 0.8, "both requests sent")
        assert pd_router.prefill.completed == 0
        thread.join(5)
    assert result["r"].status_code == 200 and result["r"].json()["served_by"] == "d0"


@pytest.mark.parametrize("pd_router", ["read"], indirect=True)
def test_read_mode_prefill_error_goes_to_client_and_decode_is_not_called(pd_router):
    pd_router.prefill.fail_status = 500
    resp = pd_router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "p0 fails on purpose"
    assert pd_router.decode.received == []


@pytest.mark.parametrize("pd_router", ["read", "write"], indirect=True)
def test_upstream_4xx_passes_through_unchanged(pd_router):
    pd_router.prefill.fail_status = 422
    # A real write-mode decode shows output only after prefill pushed the KV and the first token, which
    # a failing prefill never does; the fake answers at once unless delayed, and the router relays output
    # that comes before prefill's answer (test_router_write_relay covers that order).
    pd_router.decode.delay_s = 0.5
    resp = pd_router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 422
    assert resp.json() == {"error": {"message": "p0 fails on purpose", "type": "server_error",
                                     "param": None, "code": 422}}


def test_write_mode_prefill_failure_cancels_decode(pd_router):
    p, d = pd_router.prefill, pd_router.decode
    p.fail_status, p.delay_s = 500, 0.3  # P fails after D has the request
    d.delay_s = 5.0
    resp = pd_router.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "p0 fails on purpose"
    assert len(d.received) == 1
    wait_for(lambda: d.cancelled == 1, 3, "decode request cancelled")
    assert d.completed == 0


def test_write_mode_decode_failure_cancels_prefill(pd_router):
    p, d = pd_router.prefill, pd_router.decode
    p.delay_s = 5.0
    d.fail_status, d.delay_s = 503, 0.3
    resp = pd_router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "d0 fails on purpose"
    wait_for(lambda: p.cancelled == 1, 3, "prefill request cancelled")
    assert p.completed == 0


@pytest.mark.parametrize("pd_router", ["read", "write"], indirect=True)
def test_client_disconnect_cancels_decode_stream(pd_router):
    d = pd_router.decode
    d.chunk_delay_s = 1.0
    with pd_router.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        first = next(resp.iter_raw())
        assert json.loads(sse_events(first.decode())[0])["choices"][0]["text"] == STREAM_TEXTS[0]
    wait_for(lambda: d.cancelled == 1, 3, "decode stream closed after the client left")
    wait_for(lambda: pd_router.registered()["d0"]["num_inflight"] == 0, 3, "in-flight count released")


def test_client_disconnect_while_waiting_cancels_upstreams(pd_router):
    p, d = pd_router.prefill, pd_router.decode
    p.delay_s = d.delay_s = 5.0
    with pytest.raises(httpx.ReadTimeout):
        pd_router.client.post("/v1/completions", json=COMPLETION, timeout=0.5)
    wait_for(lambda: p.cancelled == 1 and d.cancelled == 1, 3, "both upstream requests cancelled")


def test_decode_unreachable_gives_502_and_is_not_routed_again(make_router):
    router = make_router(kv_mode="read")
    router.add("prefill", "p0")
    d = router.add("decode", "d0")
    router.wait_routable("p0", "d0")
    d.server.stop()  # dies, but its registration thread still pings
    resp = router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "upstream_unreachable" and "d0" in error["message"]
    assert router.registered()["d0"]["healthy"] is False
    # Not routed to while its health check keeps failing: no pair left.
    resp = router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_instance"


def test_upstream_timeout_gives_504(make_router):
    router = make_router(request_timeout_s=0.5)
    inst = router.add("collocated", "c0")
    router.wait_routable("c0")
    inst.delay_s = 3.0
    resp = router.client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"


def test_collocated_gets_the_request_unchanged(make_router):
    router = make_router()
    c = router.add("collocated", "c0")
    router.wait_routable("c0")
    raw = b'{"model": "fake-model",  "prompt": "x", "stream": true}'
    resp = router.client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200 and sse_events(resp.text)[-1] == "[DONE]"
    assert c.bodies() == [json.loads(raw)] and "kv_transfer_params" not in c.bodies()[0]
    assert c.received[0]["headers"]["x-request-id"] == resp.headers["x-request-id"]


def test_pd_pair_preferred_over_collocated(make_router):
    router = make_router()
    router.add("collocated", "c0")
    router.add("prefill", "p0")
    d = router.add("decode", "d0")
    router.wait_routable("c0", "p0", "d0")
    for _ in range(3):
        assert router.client.post("/v1/completions", json=COMPLETION).json()["served_by"] == "d0"
    assert len(d.received) == 3

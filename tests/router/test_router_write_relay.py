"""Write mode relays decode's output as soon as decode shows some, without waiting for prefill's
HTTP answer. Reference: the write-mode contract in router/orchestrator.py's docstring (decode's
first token comes from prefill after prefill pushed all KV, so decode's output implies prefill's
work succeeded); fake instances from router_fakes."""
import json
import logging
import time

import pytest

from tests.router.router_fakes import STREAM_TEXTS, wait_for
from tests.router.test_router_pd import CHAT, COMPLETION, sse_events


def _texts(events: list[str], chat: bool = False) -> list[str]:
    choices = [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]
    return [c["delta"]["content"] if chat else c["text"] for c in choices]


def _inflight_released(router) -> None:
    wait_for(lambda: all(i["num_inflight"] == 0 for i in router.registered().values()), 3, "in-flight counts at 0")


@pytest.mark.parametrize("path, body, chat", [("/v1/completions", {**COMPLETION, "stream": True}, False),
                                              ("/v1/chat/completions", CHAT, True)])
def test_decode_output_is_relayed_before_prefill_answers(pd_router, path, body, chat):
    p = pd_router.prefill
    p.delay_s = 2.0  # P's HTTP answer comes long after D streamed everything
    start = time.monotonic()
    resp = pd_router.client.post(path, json=body)
    elapsed = time.monotonic() - start
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and _texts(events, chat) == STREAM_TEXTS
    assert elapsed < 1.5, f"the client waited {elapsed:.2f} s, i.e. for the prefill's answer"
    # P's call is awaited, not cancelled, when D's stream ends
    wait_for(lambda: p.completed == 1, 5, "prefill answered")
    assert p.cancelled == 0
    _inflight_released(pd_router)


@pytest.mark.parametrize("stream", [True, False])
def test_prefill_failing_after_decode_output_is_logged_and_decode_answer_kept(pd_router, caplog, stream):
    p = pd_router.prefill
    p.fail_status, p.delay_s = 500, 0.5
    with caplog.at_level(logging.WARNING, logger="tandem.router.orchestrator"):
        resp = pd_router.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert resp.status_code == 200
        if stream:
            assert _texts(sse_events(resp.text)) == STREAM_TEXTS
        else:
            assert resp.json()["served_by"] == "d0"
        wait_for(lambda: p.completed == 1, 5, "prefill's failing answer read")
        wait_for(lambda: "prefill failed after decode's output" in caplog.text, 3, "late prefill failure logged")
    _inflight_released(pd_router)


def test_prefill_failing_before_decode_output_wins_over_decode_error_event(pd_router):
    # D's first event is an error (what a decode whose KV never came sends): that is no output,
    # so P's answer is awaited and P's failure is the client's answer
    p, d = pd_router.prefill, pd_router.decode
    p.fail_status, p.delay_s = 500, 0.3
    d.error_event_first, d.chunk_delay_s = True, 1.0
    resp = pd_router.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "p0 fails on purpose"
    wait_for(lambda: d.cancelled == 1, 3, "decode stream closed")
    _inflight_released(pd_router)


def test_decode_error_event_is_relayed_once_prefill_answered(pd_router):
    p, d = pd_router.prefill, pd_router.decode
    p.delay_s = 0.3
    d.error_event_first = True
    resp = pd_router.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert json.loads(events[0])["error"]["message"] == "d0 stream error"
    assert p.completed == 1 and p.cancelled == 0  # P answered before anything was relayed


def test_client_leaving_after_relay_start_cancels_pending_prefill(pd_router):
    p, d = pd_router.prefill, pd_router.decode
    p.delay_s, d.chunk_delay_s = 5.0, 1.0
    with pd_router.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        first = next(resp.iter_raw())
        assert json.loads(sse_events(first.decode())[0])["choices"][0]["text"] == STREAM_TEXTS[0]
    wait_for(lambda: d.cancelled == 1 and p.cancelled == 1, 3, "decode and prefill requests closed")
    _inflight_released(pd_router)

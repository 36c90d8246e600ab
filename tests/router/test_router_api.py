"""The router's HTTP surface: OpenAI-style errors, API key, /v1/models, /metrics, /instances."""
import pytest

COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


def _assert_openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_instances_gives_503(make_router, path):
    router = make_router()
    error = _assert_openai_error(router.client.post(path, json=COMPLETION), 503)
    assert error["code"] == "no_instance" and "no healthy instance" in error["message"]


def test_only_prefill_gives_503_naming_the_missing_role(make_router):
    router = make_router()
    router.add("prefill", "p0")
    router.wait_routable("p0")
    error = _assert_openai_error(router.client.post("/v1/completions", json=COMPLETION), 503)
    assert "no healthy decode instance" in error["message"]


def test_unknown_route_gives_404_json(make_router):
    router = make_router()
    error = _assert_openai_error(router.client.get("/v1/nothing"), 404)
    assert error["type"] == "not_found_error"
    _assert_openai_error(router.client.get("/v1/completions"), 405)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_json_gives_400(make_router, raw):
    router = make_router()
    resp = router.client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    error = _assert_openai_error(resp, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def test_api_key_enforced_on_v1_routes(make_router):
    router = make_router(api_key="sk-test")
    router.add("collocated", "c0")
    router.wait_routable("c0")
    for path in ["/v1/completions", "/v1/chat/completions"]:
        error = _assert_openai_error(router.client.post(path, json=COMPLETION), 401)
        assert error["type"] == "authentication_error"
    _assert_openai_error(router.client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    ok = router.client.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200 and ok.json()["served_by"] == "c0"
    assert router.instances[0].received[0]["headers"]["authorization"] == "Bearer sk-test"  # forwarded
    assert router.client.get("/health").status_code == 200  # not a /v1 route
    assert router.client.get("/metrics").status_code == 200
    for path in ("/docs", "/openapi.json", "/instances"):  # the API description and the instance list
        _assert_openai_error(router.client.get(path), 401)
        assert router.client.get(path, headers={"Authorization": "Bearer sk-test"}).status_code == 200


def test_models_from_a_healthy_instance(make_router):
    router = make_router()
    _assert_openai_error(router.client.get("/v1/models"), 503)
    router.add("decode", "d0")
    router.wait_routable("d0")
    models = router.client.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["owned_by"] == "d0"


def test_metrics_count_requests_failures_and_instances(make_router):
    router = make_router(kv_mode="read")
    router.add("prefill", "p0")
    d = router.add("decode", "d0")
    router.wait_routable("p0", "d0")
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 200
    d.fail_status = 500
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 500
    text = router.client.get("/metrics").text
    assert 'tandem_router_requests_total{endpoint="/v1/completions",target="pd_read"} 2.0' in text
    assert 'tandem_router_request_failures_total{endpoint="/v1/completions",status="500"} 1.0' in text
    assert 'tandem_router_instance_requests_total{instance_id="p0",role="prefill"} 2.0' in text
    assert 'tandem_router_instance_failures_total{instance_id="d0",role="decode"} 1.0' in text
    assert "tandem_router_requests_in_flight 0.0" in text
    assert 'tandem_router_instances{role="decode"} 1.0' in text
    assert "tandem_router_prefill_seconds_count 2.0" in text


def test_instances_lists_the_registry(make_router):
    router = make_router(kv_mode="read", routing_policy="least_load")
    router.add("collocated", "c0")
    router.wait_routable("c0")
    body = router.client.get("/instances").json()
    assert body["kv_mode"] == "read" and body["routing_policy"] == "least_load"
    (entry,) = body["instances"]
    assert entry["instance_id"] == "c0" and entry["role"] == "collocated" and entry["healthy"] is True
    assert entry["num_inflight"] == 0 and "type" not in entry


def test_openai_client_through_the_router(pd_router):
    """Reference: the official openai client parses the relayed SSE stream and the error JSON."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=pd_router.server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="fake-model", prompt="hi", max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == "Hello, world!"
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                          stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chat) == "Hello, world!"
    pd_router.prefill.fail_status = 500
    pd_router.decode.delay_s = 0.5  # as a real write-mode decode, silent while its prefill fails (test_router_pd)
    with pytest.raises(openai.InternalServerError, match="p0 fails on purpose"):
        client.completions.create(model="fake-model", prompt="hi", max_tokens=4)

"""The registry: ZMQ pings through the real RegistrationClient, health-checked admission, liveness
timeout, unregister, and the registry's views (/instances, /health, /metrics)."""
import argparse
import time

import msgspec
import pytest
import zmq

from tandem.router.app import run_router
from tandem.router.config import RouterConfig, add_router_args
from tandem.server.registration import RegistrationClient
from tandem.server.registry_protocol import (InstanceInfo, LoadReport, RegisterMessage, UnregisterMessage,
                                             decode_message, encode_message)
from tests.router.router_fakes import FakeInstance, ServerThread, free_port, wait_for

COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


def test_protocol_roundtrip_and_wire_format():
    msg = RegisterMessage(instance_id="p0", role="prefill", http_address="http://h:1", engine_id="e",
                          kv_host="h", kv_handshake_port=5, kv_notify_port=6, tp_size=2, dp_size=1,
                          load=LoadReport(num_running=1, num_waiting=2, kv_cache_usage=0.5))
    wire = msgspec.msgpack.decode(encode_message(msg))
    assert wire == {"type": "register", "instance_id": "p0", "role": "prefill", "http_address": "http://h:1",
                    "engine_id": "e", "kv_host": "h", "kv_handshake_port": 5, "kv_notify_port": 6,
                    "tp_size": 2, "dp_size": 1,
                    "load": {"num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.5}}
    assert decode_message(encode_message(msg)) == msg
    assert msgspec.msgpack.decode(encode_message(UnregisterMessage("p0"))) == {"type": "unregister",
                                                                              "instance_id": "p0"}
    with pytest.raises(msgspec.ValidationError):
        decode_message(msgspec.msgpack.encode({"type": "register", "instance_id": "x", "role": "oracle",
                                               "http_address": "http://h:1"}))


def test_config_from_args_and_shared_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9000)  # as the server CLI already has it
    add_router_args(parser)
    config = RouterConfig.from_args(parser.parse_args(["--kv-mode", "read", "--routing-policy", "least_load",
                                                       "--registry-port", "31000", "--instance-timeout", "3"]))
    assert (config.port, config.kv_mode, config.routing_policy) == (9000, "read", "least_load")
    assert (config.registry_port, config.instance_timeout_s, config.ping_interval_s) == (31000, 3.0, 1.0)
    assert RouterConfig.from_args(add_router_args(argparse.ArgumentParser()).parse_args([])) == RouterConfig()
    with pytest.raises(ValueError, match="instance_timeout_s"):
        RouterConfig(ping_interval_s=2.0, instance_timeout_s=1.0)


def test_registration_reports_info_and_load(make_router):
    router = make_router()
    d = router.add("decode", "d0")
    d.load = {"num_running": 3, "num_waiting": 1, "kv_cache_usage": 0.25}
    router.wait_routable("d0")
    wait_for(lambda: router.registered()["d0"]["load"]["num_running"] == 3, 3, "load refreshed")
    entry = router.registered()["d0"]
    assert entry["role"] == "decode" and entry["http_address"] == d.url
    assert entry["engine_id"] == "engine-d0" and entry["kv_handshake_port"] == d.kv_port
    assert entry["kv_notify_port"] == d.kv_port + 1 and entry["load"]["kv_cache_usage"] == 0.25
    assert entry["seconds_since_ping"] < 1.0


def test_instance_failing_health_check_is_not_added_until_healthy(make_router):
    router = make_router()
    c = router.add("collocated", "c0", register=False)
    c.healthy = False
    c.register()
    time.sleep(0.5)  # several pings, each health-checked
    assert "c0" not in router.registered()
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 503
    c.healthy = True
    router.wait_routable("c0", timeout_s=3)
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_silent_instance_is_dropped_within_timeout(make_router):
    router = make_router(instance_timeout_s=0.6)
    router.add("collocated", "c0")
    c1 = router.add("collocated", "c1")
    router.wait_routable("c0", "c1")
    c1.stop_pinging(unregister=False)  # crashed: no unregister
    start = time.monotonic()
    wait_for(lambda: "c1" not in router.registered(), 2.0, "c1 dropped")
    assert time.monotonic() - start < 0.6 + 0.5
    before = len(c1.received)
    for _ in range(4):
        assert router.client.post("/v1/completions", json=COMPLETION).json()["served_by"] == "c0"
    assert len(c1.received) == before


def test_unregister_on_clean_stop(make_router):
    router = make_router(instance_timeout_s=30.0)
    d = router.add("collocated", "c0")
    router.wait_routable("c0")
    d.stop_pinging(unregister=True)
    wait_for(lambda: "c0" not in router.registered(), 1.0, "c0 unregistered")


def test_unhealthy_instance_recovers_at_next_ping(make_router):
    router = make_router()
    c = router.add("collocated", "c0")
    router.wait_routable("c0")
    port = c.server.port
    c.server.stop()
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 502
    assert router.registered()["c0"]["healthy"] is False
    # The same instance comes back on the same address: the next ping's health check readmits it.
    c.server = ServerThread(c._build_app(), port=port).start()
    router.wait_routable("c0", timeout_s=3)
    assert router.client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_malformed_registry_message_is_ignored(make_router):
    router = make_router()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(router.registry_address)
    sock.send(b"\x93not msgpack of a register message")
    sock.send(msgspec.msgpack.encode({"type": "register", "instance_id": "x"}))  # missing fields
    sock.close()
    ctx.term()
    router.add("collocated", "c0")
    router.wait_routable("c0")
    assert list(router.registered()) == ["c0"]


def test_health_endpoint_needs_a_pair_or_collocated(make_router):
    router = make_router()
    resp = router.client.get("/health")
    assert resp.status_code == 503 and resp.json()["reason"] == "no instance registered"
    router.add("prefill", "p0")
    router.wait_routable("p0")
    resp = router.client.get("/health")
    assert resp.status_code == 503 and "decode" in resp.json()["reason"]
    router.add("decode", "d0")
    router.wait_routable("d0")
    resp = router.client.get("/health")
    assert resp.status_code == 200
    assert resp.json()["instances"] == {"prefill": 1, "decode": 1, "collocated": 0}


def test_registration_client_survives_a_broken_load_fn():
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        info = InstanceInfo(instance_id="x", role="decode", http_address="http://127.0.0.1:1")
        client = RegistrationClient(f"127.0.0.1:{port}", info, 0.05, lambda: 1 / 0)
        client.start()
        try:
            assert sock.poll(3000), "no ping arrived"
            msg = decode_message(sock.recv())
            assert isinstance(msg, RegisterMessage) and msg.load == LoadReport()
        finally:
            client.stop()
        messages = []
        while not messages or isinstance(messages[-1], RegisterMessage):
            assert sock.poll(2000), f"no unregister after {messages}"
            messages.append(decode_message(sock.recv()))
        assert messages[-1] == UnregisterMessage("x")


def test_run_router_fails_loudly_when_the_registry_port_is_taken():
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        config = RouterConfig(host="127.0.0.1", port=free_port(), registry_host="127.0.0.1", registry_port=port)
        with pytest.raises(SystemExit) as exit_info:
            run_router(config)
        assert exit_info.value.code != 0


def test_instance_started_before_the_router_registers_once_it_is_up(make_router):
    registry_port = free_port()
    early = FakeInstance("collocated", "early", f"tcp://127.0.0.1:{registry_port}", ping_interval_s=0.1)
    try:
        early.start()
        time.sleep(0.5)  # pinging while nobody listens: dropped, not queued without bound
        router = make_router(registry_port=registry_port)
        router.wait_routable("early", timeout_s=3)
        assert router.client.post("/v1/completions", json=COMPLETION).json()["served_by"] == "early"
    finally:
        early.stop_pinging()
        early.server.stop()


def test_dropped_decode_is_announced_to_prefills():
    """A decode that stops pinging is dropped, and every prefill's KV connector is told
    (PeerGone with the decode's KV address), so it frees the blocks it holds for it now.
    Reference: the message a bound ROUTER socket at the prefill's KV port receives."""
    import asyncio

    from tandem.connectors.protocol import PeerGone, decoder
    from tandem.router.registry import Instance, InstanceRegistry

    ctx = zmq.Context()
    kv = ctx.socket(zmq.ROUTER)
    port = kv.bind_to_random_port("tcp://127.0.0.1")
    registry = InstanceRegistry(RouterConfig(instance_timeout_s=2.0), client=None)

    def instance(role, name, kv_port, last_seen):
        return Instance(RegisterMessage(instance_id=name, role=role, http_address="http://127.0.0.1:1",
                                        engine_id=name, kv_host="127.0.0.1", kv_handshake_port=kv_port),
                        last_seen=last_seen)
    now = time.monotonic()
    registry._instances = {"p0": instance("prefill", "p0", port, now), "d0": instance("decode", "d0", 4242, now - 10)}
    try:
        registry.sweep(now)
        assert set(registry._instances) == {"p0"}
        assert kv.poll(2000), "no PeerGone reached the prefill"
        _, frame = kv.recv_multipart()
        assert decoder.decode(frame) == PeerGone("127.0.0.1:4242")
    finally:
        asyncio.run(registry.stop())
        kv.close(0)
        ctx.term()

"""Routing policies: unit tests on the policy objects, then end to end through the router."""
import time

from tandem.router.policy import LeastLoadPolicy, RoundRobinPolicy
from tandem.server.registry_protocol import LoadReport, RegisterMessage
from tandem.router.registry import Instance
from tests.router.router_fakes import wait_for

COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


def _instance(instance_id: str, running: int = 0, waiting: int = 0, inflight: int = 0) -> Instance:
    info = RegisterMessage(instance_id=instance_id, role="decode", http_address="http://127.0.0.1:1",
                           load=LoadReport(num_running=running, num_waiting=waiting))
    return Instance(info=info, last_seen=time.monotonic(), num_inflight=inflight)


def test_round_robin_cycles_per_role():
    policy = RoundRobinPolicy()
    a, b = _instance("a"), _instance("b")
    assert [policy.choose("decode", [b, a]).instance_id for _ in range(4)] == ["a", "b", "a", "b"]
    assert policy.choose("prefill", [a, b]).instance_id == "a"  # its own counter


def test_least_load_counts_reported_load_and_router_inflight():
    policy = LeastLoadPolicy()
    busy, idle = _instance("busy", running=5), _instance("idle", waiting=1)
    assert policy.choose("decode", [busy, idle]) is idle
    idle.num_inflight = 5
    assert policy.choose("decode", [busy, idle]) is busy
    tied = [_instance("x", running=1), _instance("y", inflight=1)]
    assert {policy.choose("decode", tied).instance_id for _ in range(4)} == {"x", "y"}


def test_round_robin_spreads_over_two_prefill_and_two_decode(make_router):
    router = make_router(kv_mode="read", routing_policy="round_robin")
    fakes = [router.add("prefill", "p0"), router.add("prefill", "p1"),
             router.add("decode", "d0"), router.add("decode", "d1")]
    router.wait_routable("p0", "p1", "d0", "d1")
    served = [router.client.post("/v1/completions", json=COMPLETION).json()["served_by"] for _ in range(8)]
    assert sorted(served) == ["d0"] * 4 + ["d1"] * 4
    assert [len(f.received) for f in fakes] == [4, 4, 4, 4]


def test_least_load_prefers_the_idle_instance(make_router):
    router = make_router(kv_mode="write", routing_policy="least_load")
    router.add("prefill", "p0")
    busy_p = router.add("prefill", "p1")
    busy_d, idle_d = router.add("decode", "d0"), router.add("decode", "d1")
    busy_p.load = {"num_running": 8, "num_waiting": 2, "kv_cache_usage": 0.9}
    busy_d.load = {"num_running": 4, "num_waiting": 0, "kv_cache_usage": 0.5}
    router.wait_routable("p0", "p1", "d0", "d1")
    wait_for(lambda: router.registered()["d0"]["load"]["num_running"] == 4
             and router.registered()["p1"]["load"]["num_running"] == 8, 3, "loads reported")
    for _ in range(3):
        assert router.client.post("/v1/completions", json=COMPLETION).json()["served_by"] == "d1"
    assert len(idle_d.received) == 3 and busy_d.received == [] and busy_p.received == []

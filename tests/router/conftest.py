"""Fixtures for the router tests: a real router (uvicorn in a thread, loopback, free ports) and fake
instances that register with it through the real RegistrationClient. Everything started here is
stopped at teardown."""
import httpx
import pytest

from tandem.router.app import build_app
from tandem.router.config import RouterConfig
from tests.router.router_fakes import FakeInstance, ServerThread, free_port, wait_for

FAST_TIMINGS = dict(ping_interval_s=0.1, instance_timeout_s=1.0, health_check_timeout_s=0.5,
                    connect_timeout_s=1.0, request_timeout_s=10.0)


class RouterHarness:
    """One router plus the fake instances of a test."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.server = ServerThread(build_app(config), port=config.port).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=10.0, trust_env=False)
        self.instances: list[FakeInstance] = []

    @property
    def registry_address(self) -> str:
        return f"tcp://127.0.0.1:{self.config.registry_port}"

    def add(self, role: str, instance_id: str, register: bool = True) -> FakeInstance:
        inst = FakeInstance(role, instance_id, self.registry_address, self.config.ping_interval_s)
        self.instances.append(inst)
        return inst.start(register)

    def registered(self) -> dict[str, dict]:
        key = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        return {i["instance_id"]: i for i in self.client.get("/instances", headers=key).json()["instances"]}

    def wait_routable(self, *instance_ids: str, timeout_s: float = 5.0) -> None:
        def ready():
            known = self.registered()
            return all(i in known and known[i]["healthy"] for i in instance_ids)
        wait_for(ready, timeout_s, f"instances {instance_ids} registered and healthy")

    def close(self) -> None:
        for inst in self.instances:
            inst.stop_pinging(unregister=True)
        self.client.close()
        servers = [inst.server for inst in self.instances if inst.server.thread.is_alive()] + [self.server]
        for server in servers:  # all at once: each takes a few uvicorn ticks to stop
            server.signal_stop()
        for server in servers:
            server.join()


@pytest.fixture
def make_router():
    harnesses: list[RouterHarness] = []

    def make(**overrides) -> RouterHarness:
        defaults = dict(host="127.0.0.1", port=free_port(), registry_host="127.0.0.1", registry_port=free_port())
        config = RouterConfig(**{**defaults, **FAST_TIMINGS, **overrides})
        harness = RouterHarness(config)
        harnesses.append(harness)
        return harness

    yield make
    for harness in harnesses:
        harness.close()


@pytest.fixture
def pd_router(make_router, request):
    """A router (kv_mode from the test's parametrization, default write) with 1 prefill + 1 decode."""
    kv_mode = getattr(request, "param", "write")
    router = make_router(kv_mode=kv_mode)
    router.prefill = router.add("prefill", "p0")
    router.decode = router.add("decode", "d0")
    router.wait_routable("p0", "d0")
    return router


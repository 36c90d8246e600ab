"""Prometheus metrics of one router, in a registry of its own (so several routers can live in one
process, as in tests)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_router_requests", "Client requests received",
                                ["endpoint", "target"], registry=r)
        self.failures = Counter("tandem_router_request_failures", "Client requests answered with an error",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("tandem_router_requests_in_flight", "Client requests being served",
                               registry=r)
        self.instance_requests = Counter("tandem_router_instance_requests", "Requests sent to an instance",
                                         ["instance_id", "role"], registry=r)
        self.instance_failures = Counter("tandem_router_instance_failures",
                                         "Requests to an instance that failed (connect, timeout, error status)",
                                         ["instance_id", "role"], registry=r)
        self.instances = Gauge("tandem_router_instances", "Routable instances by role", ["role"], registry=r)
        self.prefill_seconds = Histogram(
            "tandem_router_prefill_seconds", "Time from sending a request to prefill until its answer",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0), registry=r)

        self.instance_in_flight = Gauge("tandem_router_instance_in_flight",
                                        "Requests the router has open to an instance", ["instance_id", "role"],
                                        registry=r)
        self.instance_pending = Gauge("tandem_router_instance_pending",
                                      "An instance's reported running + waiting requests", ["instance_id", "role"],
                                      registry=r)

    def observe_instances(self, instances: list[dict]) -> None:
        """Refresh the per-instance gauges from a registry snapshot (dropped instances disappear)."""
        self.instance_in_flight.clear()
        self.instance_pending.clear()
        for inst in instances:
            labels = (inst["instance_id"], inst["role"])
            self.instance_in_flight.labels(*labels).set(inst["num_inflight"])
            self.instance_pending.labels(*labels).set(inst["load"]["num_running"] + inst["load"]["num_waiting"])

    def render(self) -> bytes:
        return generate_latest(self.registry)

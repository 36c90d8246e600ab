"""deploy/grafana/tandem.json: a loadable dashboard whose every PromQL expression parses
(promql-parser) and names only series the code exports. Reference: the samples the server's
and the router's metric registries render after one observation of each kind."""
import json
import re

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.deploy_tools import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "tandem.json"
# What the dashboard must show (the list): latency, queue, KV cache, PD transfers, router.
REQUIRED = {
    "tandem:time_to_first_token_seconds_bucket", "tandem:time_per_output_token_seconds_bucket",
    "tandem:inter_token_latency_seconds_bucket", "tandem:num_requests_running", "tandem:num_requests_waiting",
    "tandem:kv_cache_usage_perc", "tandem:num_requests_waiting_for_remote_kvs", "tandem:num_remote_prefills",
    "tandem_router_requests_total", "tandem_router_instances", "tandem_router_prefill_seconds_bucket",
    "tandem:request_kv_transfer_wait_time_seconds_bucket",
}


def exported_samples() -> set[str]:
    from tandem.engine.protocol import RequestTimes, SchedulerStats
    from tandem.router.metrics import RouterMetrics
    from tandem.server.metrics import ServerMetrics

    server = ServerMetrics("m")
    server.observe_finished("stop", 0.0, 0.1, 1.0, 5, 3)
    server.observe_aborted(1, 0)
    server.ttft.observe(0.1)
    server.itl.observe(0.01)
    server.set_engine_stats(SchedulerStats(num_running=1))
    server.observe_times(RequestTimes(queue=0.01, prefill=0.1, decode=0.5, inference=0.6, kv_transfer_wait=0.02))
    router = RouterMetrics()
    router.requests.labels("/v1/completions", "pd").inc()
    router.failures.labels("/v1/completions", "503").inc()
    router.instance_requests.labels("p0", "prefill").inc()
    router.instance_failures.labels("p0", "prefill").inc()
    router.instances.labels("prefill").set(1)
    router.prefill_seconds.observe(0.2)
    router.observe_instances([{"instance_id": "p0", "role": "prefill", "num_inflight": 0,
                               "load": {"num_running": 0, "num_waiting": 0}}])
    names = set()
    for text in (server.render(), router.render()):
        for family in text_string_to_metric_families(text.decode()):
            names |= {s.name for s in family.samples}
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def selectors(expr: str) -> set[str]:
    """Metric names of an expression, after Grafana's own variables are substituted."""
    expr = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
    m = re.fullmatch(r"label_values\((\S+), \w+\)", expr)
    if m:  # a Grafana variable query, not PromQL
        expr = m.group(1)
    names = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_dashboard_shape(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_every_series_is_exported_and_the_essentials_are_shown(dashboard):
    exported = exported_samples()
    used = set()
    for expr in expressions(dashboard):
        names = selectors(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} reads {sorted(unknown)}, which neither the server nor the router exports"
        used |= names
    assert REQUIRED <= exported, f"the code no longer exports {sorted(REQUIRED - exported)}"
    missing = REQUIRED - used
    assert not missing, f"the dashboard does not show {sorted(missing)}"


def test_name_check_is_live():
    assert selectors("rate(tandem:time_to_first_token_bucket[5m])") - exported_samples() == {
        "tandem:time_to_first_token_bucket"}
    with pytest.raises(Exception):
        promql_parser.parse("sum(rate(tandem:num_requests_running[5m])")

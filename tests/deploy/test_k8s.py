"""deploy/k8s: every overlay renders with kustomize (the one built into kubectl) and each object
validates strictly against the Kubernetes OpenAPI schemas (kubernetes-validate); the
LeaderWorkerSet, a CRD, against its own CRD schema (vendored, tests/deploy/schemas/README.md)
with its pod templates checked as core PodTemplates. Then the wiring: every container command
is one `server` accepts once Kubernetes has expanded its $(VARS), instances register with the
router's registry Service, probes hit /health, and the NetworkPolicies open only the right ports."""
import copy
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.deploy_tools import DEPLOY, parse_server_args, tool

K8S = DEPLOY / "k8s"
OVERLAYS = ["base", "overlays/cuda", "overlays/rocm", "overlays/multinode"]
LWS_SCHEMA = Path(__file__).parent / "schemas" / "leaderworkerset-v1.json"
INSTANCE_ROLES = {"prefill", "decode"}


def render(overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(K8S / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def _strict(schema):
    """Like `kubernetes-validate --strict`: objects with listed properties allow no others."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    return [_strict(v) for v in schema] if isinstance(schema, list) else schema


def validate(doc: dict) -> None:
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        return
    schema = _strict(json.loads(LWS_SCHEMA.read_text()))
    schema["properties"]["metadata"].pop("additionalProperties", None)  # ObjectMeta is free-form here
    jsonschema.validate(doc, schema)
    for key, template in doc["spec"]["leaderWorkerTemplate"].items():
        if key.endswith("Template"):
            validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key.lower()},
                      "template": template})


def test_objects_validate(rendered):
    _, docs = rendered
    assert docs
    for doc in docs:
        validate(doc)


def test_validation_is_live():
    """A misspelt probe field, and a LeaderWorkerSet without its size type, are refused."""
    docs = render("overlays/multinode")
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    lws = copy.deepcopy(next(d for d in docs if d["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws = copy.deepcopy(next(d for d in docs if d["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(lws)


def pod_templates(docs: list[dict]):
    """(object, pod template) for every Deployment and every LeaderWorkerSet template."""
    for d in docs:
        if d["kind"] == "Deployment":
            yield d, d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            yield d, lwt.get("leaderTemplate") or lwt["workerTemplate"]
            if "leaderTemplate" in lwt:
                yield d, lwt["workerTemplate"]


def expand(args: list[str], container: dict, docs: list[dict]) -> list[str]:
    """Kubernetes' $(VAR) expansion, from the container's env, its envFrom ConfigMaps, and the
    variables the LeaderWorkerSet controller sets; an unknown $(VAR) fails the test."""
    env = {"LWS_LEADER_ADDRESS": "tandem-decode-0.tandem-decode", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in maps, f"envFrom names ConfigMap {name}, which the overlay does not render"
        env.update(maps[name])
    for var in container.get("env", []):
        env[var["name"]] = "10.0.0.7" if "valueFrom" in var else var["value"]

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) has no source in {container['name']}"
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", sub, a) for a in args]


def test_commands_are_accepted_by_server(rendered):
    _, docs = rendered
    roles = set()
    for _, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            assert c["image"].startswith("tandem")
            args = parse_server_args(expand(c["args"], c, docs))
            roles.add(args.role)
            if args.role in INSTANCE_ROLES and not args.node_rank:  # node 0 serves and registers
                assert args.router_address == "tandem-router-registry:30001"
                assert args.kv_transport in ("tcp", "mori")
    assert roles == {"router", "prefill", "decode"}


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_router_and_registry_services():
    docs = render("base")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tandem-router")
    args = parse_server_args(router["spec"]["template"]["spec"]["containers"][0]["args"])
    assert {p["port"] for p in services["tandem-router"]["spec"]["ports"]} == {args.port}
    registry = services["tandem-router-registry"]["spec"]
    assert [p["port"] for p in registry["ports"]] == [args.registry_port]
    # The router is ready only once instances registered: its registry must be reachable before.
    assert registry["publishNotReadyAddresses"] is True
    assert router["spec"]["replicas"] == 1


def test_probes_resources_and_scrape_annotations(rendered):
    overlay, docs = rendered
    for obj, template in pod_templates(docs):
        c = template["spec"]["containers"][0]
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        labels = template["metadata"]["labels"]
        if "http" not in _ports(c):
            assert labels["app.kubernetes.io/component"].endswith("-worker"), "only workers serve no HTTP"
            continue
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == _ports(c)["http"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        if labels["app.kubernetes.io/component"] in INSTANCE_ROLES:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
            gpu = "amd.com/gpu" if overlay.endswith("rocm") else "nvidia.com/gpu"
            assert c["resources"]["limits"][gpu] == c["resources"]["requests"][gpu]
            assert {"nvidia.com/gpu", "amd.com/gpu"} - {gpu} & set(c["resources"]["limits"]) == set()
            args = parse_server_args(expand(c["args"], c, docs))
            assert args.port == _ports(c)["http"] and args.kv_port == _ports(c)["kv"]


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_network_policies():
    """Instances' HTTP port: the router (and Prometheus) only; their KV port: other instances
    only; the router's registry: instances only. Port names must exist on the selected pods."""
    docs = render("overlays/cuda")
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    pods = {}
    for _, t in pod_templates(docs):
        pods[t["metadata"]["labels"]["app.kubernetes.io/component"]] = (t["metadata"]["labels"],
                                                                         _ports(t["spec"]["containers"][0]))

    def allowed(policy: dict, port: str) -> set[str]:
        """Components allowed to reach `port`, or {'*'} when any source may."""
        out = set()
        for rule in policy["ingress"]:
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            for peer in rule.get("from", [{}]):
                if "namespaceSelector" in peer or not peer:
                    out.add("*" if not peer else "prometheus")
                    continue
                out |= {name for name, (labels, _) in pods.items() if _selects(peer["podSelector"], labels)}
        return out

    inst = policies["tandem-instances"]
    for role in INSTANCE_ROLES:
        labels, ports = pods[role]
        assert _selects(inst["podSelector"], labels)
        assert {"http", "kv"} <= set(ports)
    assert allowed(inst, "http") == {"router", "prometheus"}
    assert allowed(inst, "kv") == INSTANCE_ROLES
    router = policies["tandem-router"]
    assert _selects(router["podSelector"], pods["router"][0])
    assert allowed(router, "http") == {"*"}
    assert allowed(router, "registry") == INSTANCE_ROLES
    for spec in policies.values():
        for rule in spec["ingress"]:
            for p in rule.get("ports", []):
                assert any(p["port"] in ports for labels, ports in pods.values()
                           if _selects(spec["podSelector"], labels)), f"port {p['port']} is on no selected pod"


def test_multinode_group():
    """The LeaderWorkerSet replaces the decode Deployment: leader = node 0 with HTTP, workers
    take their node rank from LWS_WORKER_INDEX; all share --nnodes, TP size and master."""
    docs = render("overlays/multinode")
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tandem-decode"]
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader_c = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker_c = lwt["workerTemplate"]["spec"]["containers"][0]
    leader = parse_server_args(expand(leader_c["args"], leader_c, docs))
    worker = parse_server_args(expand(worker_c["args"], worker_c, docs))
    assert "$(LWS_WORKER_INDEX)" in worker_c["args"][worker_c["args"].index("--node-rank=$(LWS_WORKER_INDEX)")]
    assert leader.node_rank == 0 and worker.node_rank == 1
    assert leader.nnodes == worker.nnodes == lwt["size"]
    assert leader.master_addr == worker.master_addr == "tandem-decode-0.tandem-decode"
    assert leader.tensor_parallel_size == worker.tensor_parallel_size
    gpus = int(leader_c["resources"]["limits"]["nvidia.com/gpu"])
    assert leader.tensor_parallel_size == gpus * lwt["size"], "TP spans every GPU of the group"
    assert leader_c["image"] == worker_c["image"] == "tandem:cuda"
    group = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "tandem-decode-group")
    assert group["spec"]["podSelector"]["matchLabels"] == {"leaderworkerset.sigs.k8s.io/name": "tandem-decode"}

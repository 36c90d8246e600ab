"""deploy/compose.yaml: valid against the Compose Specification's JSON schema (the copy that
check-jsonschema ships as `vendor.compose-spec`), and every service's command line is one the
`server` CLI of this checkout accepts, wired the way PD needs (ports, registry, GPUs, IPC)."""
import re
import subprocess

import pytest
import yaml

from tests.deploy.deploy_tools import DEPLOY, parse_server_args, tool

COMPOSE = DEPLOY / "compose.yaml"


def check_compose_schema(path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True)


def test_compose_file_matches_the_compose_spec():
    result = check_compose_schema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_is_live(tmp_path):
    """A misspelt service key (gpu_reservations) is refused by the same check."""
    doc = yaml.safe_load(COMPOSE.read_text())
    doc["services"]["decode"]["gpu_reservations"] = ["1"]
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = check_compose_schema(bad)
    assert result.returncode != 0 and "gpu_reservations" in result.stdout + result.stderr


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} on every string, with `env` or defaults."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(3)
        if name in env and (env[name] or m.group(2) != ":-"):
            return env[name]
        assert default is not None, f"${{{name}}} has no default in {value!r}"
        return default

    return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, value)


@pytest.fixture(scope="module")
def services() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))["services"]


def _flag(command: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} should appear once in {command}"
    return values[0]


def _health_port(service: dict) -> int:
    return int(re.search(r"127\.0\.0\.1:(\d+)/health", " ".join(service["healthcheck"]["test"])).group(1))


def test_profiles(services):
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {"router": ("pd",), "prefill": ("pd",), "decode": ("pd",), "collocated": ("collocated",)}


def test_every_command_is_accepted_by_server(services):
    for name, service in services.items():
        args = parse_server_args(service["command"])
        assert args.role == name
        assert _health_port(service) == args.port, f"{name}: the healthcheck probes another port than --port"


def test_pd_wiring(services):
    """Reference: the flags `server --role disagg` passes its children (server/roles.py), with
    the compose service names in place of 127.0.0.1."""
    router = parse_server_args(services["router"]["command"])
    published = {p.split(":")[-1] for p in services["router"]["ports"]}
    assert published == {str(router.port)}
    devices = {}
    for role in ("prefill", "decode"):
        s = services[role]
        args = parse_server_args(s["command"])
        assert args.router_address == f"router:{router.registry_port}"
        assert args.advertise_host == role, "peers and the router reach an instance by its service name"
        assert args.kv_transport == "ipc" and args.kv_port
        assert s["ipc"] == "host" and s["pid"] == "host", "CUDA IPC across containers needs both"
        gpus = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"]
        assert gpus["device_ids"] == ["0", "1"], "each instance must see both GPUs for CUDA IPC"
        devices[role] = args.device
        assert "/health" in " ".join(s["healthcheck"]["test"])
        assert "ports" not in s, "instances are reached through the router only"
    assert devices == {"prefill": "cuda:0", "decode": "cuda:1"}
    assert services["router"]["depends_on"] == {"prefill": {"condition": "service_healthy"},
                                                "decode": {"condition": "service_healthy"}}


def test_collocated_profile(services):
    s = services["collocated"]
    args = parse_server_args(s["command"])
    assert args.device == "cuda:0"
    assert s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
    assert s["shm_size"] or s.get("ipc") == "host"


def test_ports_and_model_are_variables():
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {"TANDEM_PORT": "9000", "TANDEM_MODEL": "/models/Qwen3-8B", "PREFILL_PORT": "9100", "MODEL_DIR": "/data"}
    s = interpolate(raw, env)
    assert s["router"]["ports"] == ["9000:8000"] and s["collocated"]["ports"] == ["9000:8000"]
    for role in ("prefill", "decode", "collocated"):
        assert _flag(s[role]["command"], "model") == "/models/Qwen3-8B"
        assert s[role]["volumes"] == ["/data:/models:ro"]
    assert _flag(s["prefill"]["command"], "port") == "9100" and _health_port(s["prefill"]) == 9100

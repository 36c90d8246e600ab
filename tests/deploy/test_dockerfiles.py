"""deploy/docker: hadolint (the reference Dockerfile linter) on both images, the contract every
image keeps (non-root, `server` entrypoint, /health check), the .dockerignore allow-list, and,
where a Docker daemon runs, a build of the CPU stage that must answer `server --help`."""
import json
import re
import subprocess
import tomllib

import pytest

from tests.deploy.deploy_tools import DEPLOY, ROOT, tool

DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cuda", "Dockerfile.rocm"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(path):
    # Reference: hadolint's rules at their default failure threshold (info and above).
    result = subprocess.run([tool("hadolint"), "--format", "json", str(path)], capture_output=True, text=True)
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == 0 and not findings, "\n".join(
        f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in findings) or result.stderr


def _stages(text: str) -> dict[str, list[str]]:
    """Instructions per build stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", text)
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


@pytest.mark.parametrize("path,stages", [("Dockerfile.cuda", ["cpu", "cuda"]), ("Dockerfile.rocm", ["rocm"])])
def test_runtime_stages_contract(path, stages):
    """Each runnable stage: non-root numeric user, `server` entrypoint, HEALTHCHECK on /health."""
    found = _stages((DEPLOY / "docker" / path).read_text())
    last = list(found)[-1]
    assert last == stages[-1], f"{path}: the default (last) stage should be {stages[-1]}, not {last}"
    for name in stages:
        body = found[name]
        users = [line.split()[1] for line in body if line.startswith("USER ")]
        assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", (
            f"{path}:{name} must end as a numeric non-root USER (Kubernetes runAsNonRoot checks it)")
        assert 'ENTRYPOINT ["server"]' in body, f"{path}:{name} must use `server` as its entrypoint"
        checks = [line for line in body if line.startswith("HEALTHCHECK")]
        assert checks and "/health" in checks[-1], f"{path}:{name} needs a HEALTHCHECK on /health"


def _package_dirs() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted({d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()})


def test_dockerignore_lets_the_package_and_default_model_in():
    """The allow-list lets in what `pip wheel .` needs (pyproject, README, every package folder,
    the embedded default model) and nothing else at the top level (.git, .venv, tests, data)."""
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", "the .dockerignore should start by excluding everything"
    allowed = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", *_package_dirs()}
    excluded = [l for l in lines[1:] if not l.startswith("!")]
    assert not any("default_model" in l or l.startswith("engine") for l in excluded), excluded
    assert (ROOT / "engine" / "default_model" / "config.json").exists()
    for path in DOCKERFILES:
        copied = set(re.findall(r"^COPY (\w+) \1$", path.read_text(), re.M))
        assert copied == set(_package_dirs()), f"{path.name} copies {sorted(copied)}"


def _docker_daemon() -> str | None:
    """Why no image can be built here, or None where a daemon answers."""
    import shutil
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI"
    info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        return "no Docker daemon is running (the docker CLI cannot reach one)"
    return None


@pytest.mark.slow
def test_cpu_stage_builds_and_runs_server_help():
    """Reference: the `server --help` text of this checkout's own parser."""
    reason = _docker_daemon()
    if reason:
        pytest.skip(f"cannot build images on this machine: {reason}")
    tag = "tandem-test:cpu"
    build = subprocess.run(["docker", "build", "-f", "deploy/docker/Dockerfile.cuda", "--target", "cpu", "-t", tag,
                            "."], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run(["docker", "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "--role" in run.stdout and "--kv-transport" in run.stdout and "--router-address" in run.stdout


def test_hadolint_flags_a_root_image():
    """The linter is live: an image that stays root with an unpinned apt install is reported."""
    bad = "FROM python:3.11-slim\nRUN apt-get update && apt-get install -y gcc\nUSER root\n"
    result = subprocess.run([tool("hadolint"), "--format", "json", "-"], input=bad, capture_output=True, text=True)
    codes = {f["code"] for f in json.loads(result.stdout)}
    assert result.returncode != 0 and {"DL3002", "DL3008"} <= codes, codes


def test_wheel_stage_packs_the_default_model(tmp_path):
    """What the `wheel` stage does, without Docker: `pip wheel .` over the context the
    .dockerignore lets in. Reference: the embedded default model's files in this checkout, and
    the `server` console script of pyproject.toml."""
    import shutil
    import sys
    import zipfile

    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip()]
    context = tmp_path / "context"
    context.mkdir()
    drop = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for entry in (l[1:].rstrip("/") for l in lines if l.startswith("!")):
        src = ROOT / entry
        (shutil.copytree(src, context / entry, ignore=drop) if src.is_dir() else shutil.copy(src, context / entry))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--wheel-dir", str(tmp_path / "wheels"), str(context)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = (tmp_path / "wheels").glob("tandem-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    model = {f"tandem/engine/default_model/{p.name}" for p in (ROOT / "engine" / "default_model").iterdir()}
    assert model <= names, f"the image would lack {sorted(model - names)}"
    assert "server = tandem.server.__main__:main" in entry_points
    for package in _package_dirs():
        assert f"tandem/{package}/__init__.py" in names

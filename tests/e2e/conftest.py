"""Multi-process PD deployments on CPU over the tcp transport: a router, prefill and decode
instances as real `python -m server` processes on free loopback ports."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.server.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "96",
               "--block-size", "8", "--max-num-seqs", "16", "--max-num-batched-tokens", "64"]
KV_CONFIG = '{"kv_connector_extra_config": {"transfer_timeout_s": 4, "hold_timeout_s": 4}}'


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("e2e-model"), DATA)


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, port: int | None = None):
        self.name, self.port = name, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_all_blocks_free(urls: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        free = [(metric(u, "kv_cache_free_blocks"), metric(u, "kv_cache_total_blocks")) for u in urls]
        if all(f == t for f, t in free):
            return
        assert time.monotonic() < deadline, f"KV blocks not all free: {free}"
        time.sleep(0.5)

"""Server test fixtures: a tiny random Llama (built once per session) and real `python -m tandem.server`
processes on free 127.0.0.1 ports, reaped at teardown."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_tiny_model
from tests.ports import free_port_range

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "16"]


class ServerProcess:
    """`python -m tandem.server` in a subprocess; log in `log_path`."""

    def __init__(self, log_path: Path, args: list[str]):
        """`python -m tandem.server --host 127.0.0.1 --port <free> *args`; its name is the log's stem."""
        self.name = log_path.stem
        # a block of free ports below the ephemeral range: a prefill/decode instance derives its KV,
        # KV data and rendezvous ports from --port (port + 1, ...)
        self.port = free_port_range(8)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tandem.server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = open(log_path, "w")
        self.terminated = False  # SIGTERM sent by terminate()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    @classmethod
    def for_model(cls, model_dir: Path, log_path: Path, *extra_args: str) -> "ServerProcess":
        return cls(log_path, ["--model", str(model_dir), *ENGINE_ARGS, *extra_args])

    def wait_healthy(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        """The engine core child (not multiprocessing's resource tracker)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in map(int, children):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return pid
        raise RuntimeError(f"no engine core child among {children}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM, once, if still running (stop() waits for it)."""
        if self.proc.poll() is None and not self.terminated:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def stop_all(procs, timeout: float = 30.0) -> list[int]:
    """stop() each of procs, SIGTERM to all of them first: their shutdowns (seconds each) overlap."""
    for p in procs:
        p.terminate()
    return [p.stop(timeout) for p in procs]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), GSM8K)


@pytest.fixture(scope="session")
def launched(tiny_model_dir, tmp_path_factory) -> dict[str, ServerProcess]:
    """Every server the suite needs, launched at once so their start-ups overlap:
    main (shared, with --api-key), victim (its engine gets killed), broken (cannot start)."""
    logs = tmp_path_factory.mktemp("logs")
    procs = {
        "main": ServerProcess.for_model(tiny_model_dir, logs / "main.log", "--api-key", API_KEY),
        "victim": ServerProcess.for_model(tiny_model_dir, logs / "victim.log"),
        "broken": ServerProcess.for_model(tiny_model_dir / "no-such-model", logs / "broken.log"),
    }
    yield procs
    for name, srv in procs.items():
        if name != "main":
            srv.stop()


@pytest.fixture(scope="session")
def server(launched):
    """The shared server for every functional test. Teardown checks that SIGTERM stops the
    whole tree with exit code 0."""
    srv = launched["main"].wait_healthy()
    engine_pid = srv.engine_pid()
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM:\n{srv.read_log()}"
    deadline = time.monotonic() + 10
    while pid_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine_pid), "the engine core outlived the server"


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()

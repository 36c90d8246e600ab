"""`server --role router` becomes `python -m tandem.router` (os.execv): the pid `server` started
serves the router's API itself (no child), reads its API key from a file, stops with exit code 0
on SIGTERM and with 1 when its port is taken. Reference: the router's own /health, /instances
and 401 answer, and the process table."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tandem.server.__main__ import split_role
from tests.ports import free_port_range
from tests.server.conftest import ServerProcess


def test_split_role_reads_both_spellings() -> None:
    assert split_role(["--role", "router", "--port", "1"]) == ("router", ["--port", "1"])
    assert split_role(["--port", "1", "--role=router"]) == ("router", ["--port", "1"])
    assert split_role(["--port", "1", "--help"]) == (None, ["--port", "1", "--help"])


def _wait_answering(router: ServerProcess, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert router.proc.poll() is None, router.read_log()
        try:
            return httpx.get(f"{router.url}/health", timeout=1.0)  # 503 until instances register
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(router.read_log())


def test_router_role_is_the_router_process(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("router-key\n")
    router = ServerProcess(tmp_path / "router.log", ["--role", "router", "--registry-port", str(free_port_range(1)),
                                                      "--api-key-file", str(key_file)])
    try:
        health = _wait_answering(router)
        assert health.json()["role"] == "router", health.text
        pid = router.proc.pid
        assert b"tandem.router" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert Path(f"/proc/{pid}/task/{pid}/children").read_text().split() == []
        assert httpx.get(f"{router.url}/instances", timeout=5).status_code == 401
        auth = {"Authorization": "Bearer router-key"}
        assert httpx.get(f"{router.url}/instances", headers=auth, timeout=5).json()["instances"] == []
    finally:
        code = router.stop()
    assert code == 0, router.log_path.read_text()
    assert "SIGTERM received; router stopped" in router.log_path.read_text()


def test_router_role_port_taken_exits_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tandem.server", "--role", "router", "--host", "127.0.0.1",
                               "--port", str(port), "--registry-port", str(free_port_range(1))],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr

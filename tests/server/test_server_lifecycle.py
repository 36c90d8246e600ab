"""The process tree: a dead engine core takes the server down loudly (503, non-zero exit, log
line); a failed engine start-up exits non-zero with the engine's traceback in the log."""
import os
import signal
import time

import httpx
import pytest

from conftest import pid_alive


@pytest.fixture(scope="module")
def servers(launched):
    return launched["victim"], launched["broken"]


def test_engine_start_failure_exits_non_zero_with_its_traceback(servers):
    _, broken = servers
    assert broken.proc.wait(180) == 1
    log = broken.read_log()
    assert "engine core failed to start" in log and "config.json" in log and "Traceback" in log


def test_killed_engine_core_fails_health_and_exits_non_zero(servers):
    victim, _ = servers
    victim.wait_healthy()
    engine_pid = victim.engine_pid()
    os.kill(engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{victim.url}/health", timeout=1.0).status_code == 503:
                break
        except httpx.TransportError:
            break  # already gone: also a failed health check
        time.sleep(0.05)
    else:
        pytest.fail("/health kept answering 200 after the engine core died")
    assert victim.proc.wait(30) != 0
    assert "engine core process died" in victim.read_log()
    assert not pid_alive(engine_pid)

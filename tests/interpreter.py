"""Kernel tests under the Triton interpreter (CPU): TRITON_INTERPRET must be set before triton is
imported, so a test module runs its cases in a fresh `python -m` of itself.

Each run is one interpreter process on one core for tens of seconds; the first one asked for in a
session starts those of every collected module of MODULES at once and waits for them all (the
others then find their output ready), so the runs share the machine's cores instead of taking
turns."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The modules that call run_under_interpreter (each with `python -m` of itself).
MODULES = ("tests.benchmarks.test_boundary", "tests.benchmarks.test_fp8_moe", "tests.benchmarks.test_kv_gather",
           "tests.engine.test_fp8_layers_interpreter", "tests.kernels.test_fp8", "tests.kernels.test_triton_interpreter")
collected: set[str] = set()  # the session's test modules (tests/conftest.py), to start alongside
_runs: dict[str, tuple[subprocess.Popen, Path, Path, float]] = {}  # module -> (process, stdout, stderr, start)
_outputs: dict[str, tuple[str, str]] = {}  # module -> (stdout, stderr) of a finished run


def _start(module: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out_dir = Path(tempfile.mkdtemp(prefix="interpreter-"))
    stdout, stderr = out_dir / "stdout", out_dir / "stderr"
    with open(stdout, "w") as out, open(stderr, "w") as err:  # files, not pipes: nothing blocks unread
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
    _runs[module] = proc, stdout, stderr, time.monotonic()


def _wait(module: str, timeout: float) -> None:
    """Wait for module's run (killed past `timeout` seconds from its start); keep its output."""
    proc, stdout, stderr, start = _runs[module]
    try:
        proc.wait(max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        _outputs[module] = "", f"killed after {timeout:.0f} s"
        raise
    finally:
        if module not in _outputs:
            _outputs[module] = stdout.read_text(), stderr.read_text()
        shutil.rmtree(stdout.parent, ignore_errors=True)


def run_under_interpreter(module: str, timeout: float) -> str:
    """stdout of `python -m module` with TRITON_INTERPRET=1 and no GPU visible, from the repository
    root; a non-zero exit fails the calling test with the end of its stderr."""
    if module not in _runs:
        batch = [module] + [m for m in MODULES if m in collected and m != module and m not in _runs]
        for m in batch:
            _start(m)
        for m in batch:  # all of them now: none runs on while later tests need the cores
            try:
                _wait(m, timeout)
            except subprocess.TimeoutExpired:
                if m == module:
                    raise
    elif module not in _outputs:
        _wait(module, timeout)
    proc = _runs[module][0]
    stdout, stderr = _outputs[module]
    if proc.returncode:
        pytest.fail(f"interpreter run failed ({proc.returncode}):\n{stderr[-3000:]}")
    return stdout

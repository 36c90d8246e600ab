"""Kernel tests under the Triton interpreter (CPU): TRITON_INTERPRET must be set before triton is
imported, so a test module runs its cases in a fresh `python -m` of itself."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_under_interpreter(module: str, timeout: float) -> str:
    """stdout of `python -m module` with TRITON_INTERPRET=1 and no GPU visible, from the repository
    root; a non-zero exit fails the calling test with the end of its stderr."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        pytest.fail(f"interpreter run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout

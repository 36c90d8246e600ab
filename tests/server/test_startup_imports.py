"""The API process spawns its engine core before it imports torch or transformers (its app's
modules and the tokenizer do): the two imports, seconds each, then overlap the engine core's own
instead of delaying its start. Reference: sys.modules of a fresh interpreter that has done what
run_api_server does before client.start() (the CLI parsed, the config built, the client's module loaded)."""
import subprocess
import sys

CHILD = """
import sys
from tandem.server.__main__ import build_parser
from tandem.engine.config import config_from_args
from tandem.server.engine_client import EngineClient
from tandem.server.lifecycle import GracefulServer, Lifecycle, bind_socket
config_from_args(build_parser().parse_args(["--device", "cpu", "--tensor-parallel-size", "2"]))
import tandem.kernels
tandem.kernels.KernelConfig
print(sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
"""


def test_api_process_spawns_the_engine_before_importing_torch():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_kernels_names_still_resolve():
    """The kernels package loads its names on first use (a name it lacks is still an AttributeError)."""
    import pytest

    import tandem.kernels as k
    from tandem.kernels.norm import rms_norm
    assert k.rms_norm is rms_norm and callable(k.silu_and_mul) and k.KernelConfig().__class__.__name__ == "KernelConfig"
    with pytest.raises(AttributeError):
        k.no_such_kernel

"""benchmarks.boundary: its stage kernel, chained with and without the early load, gives the torch
reference's results under the Triton interpreter (a child process); the persistent kernel, which the
interpreter cannot run (its programs run one by one and the first would wait at the barrier forever),
compiles for sm_90 to the barrier it describes. No timing."""
import json
import re

from tests.interpreter import run_under_interpreter
from tests.kernels.test_fp8 import _compile_sm90


def _child() -> None:
    import torch

    from benchmarks import boundary
    g = torch.Generator().manual_seed(0)
    programs, words, stages = 4, 64, 3
    w = torch.randint(0, 4, (stages, programs * words), dtype=torch.int32, generator=g)
    out = {}
    for early in (False, True):
        dep = torch.zeros(stages + 1, programs, dtype=torch.int32)
        dep[0] = torch.arange(programs, dtype=torch.int32)
        ref = boundary.stages_ref(w, dep[0])
        boundary.chain(w, dep, stages, early, pdl=False, warps=4)
        out[f"early {early}"] = bool(torch.equal(dep, ref))
    # each stage adds its own sums to a neighbour's value: the reference is not the sums alone
    out["ref chains"] = bool(not torch.equal(ref[2], w[1].view(programs, words).sum(-1).int()))
    print(json.dumps(out))


def test_stage_chain_matches_reference_in_interpreter():
    result = json.loads(run_under_interpreter("tests.benchmarks.test_boundary", timeout=300).strip().splitlines()[-1])
    assert result == {"early False": True, "early True": True, "ref chains": True}


def test_persistent_kernel_compiles_to_its_barrier():
    from benchmarks.boundary import _persistent_kernel, _stage_kernel
    for early in (False, True):
        ptx = _compile_sm90(_persistent_kernel, dict(w_ptr="*i32", dep_ptr="*i32", count_ptr="*i32"),
                            dict(WORDS=1024, EARLY=early), 4, 1).asm["ptx"]
        assert len(re.findall(r"red\.global\.gpu\.release\.add", ptx)) == 1, early  # the arrival
        assert "ld.global.acquire.gpu.b32" in ptx, early  # the wait
    ptx = _compile_sm90(_stage_kernel, dict(w_ptr="*i32", dep_in="*i32", dep_out="*i32"),
                        dict(WORDS=1024, EARLY=True, PDL=True), 4, 1).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


if __name__ == "__main__":
    _child()

"""benchmarks.fp8_moe's plumbing on CPU, the kernels under the Triton interpreter (a child process):
one tiny case runs the current plan, the one-GEMM-at-a-time sweep and the bf16 experts, each
checked against its torch reference (kernels.fp8.fused_experts_fp8_ref, kernels.moe.fused_experts_ref)
before it is timed; a plan that fails is reported and not timed. No timing is asserted."""
import json

from benchmarks import fp8_moe
from tests.interpreter import run_under_interpreter

TINY = dict(hidden=256, inter=128, experts=8, top_k=2)
TOKENS = 3
CANDS = [(16, 1, 2), (32, 2, 3), (24, 1, 2)]  # 24: not a power of two, the kernel cannot be built


def _child() -> None:
    import torch

    import tandem.kernels.triton.fp8 as triton_fp8
    from tandem.kernels.fp8 import quantize_rows
    # the interpreter's e4m3 cast misrounds (tests/kernels/test_fp8.py): quantize as the reference does
    triton_fp8.quantize_rows_triton = lambda x, dtype, group, pdl=False, blocks=None: quantize_rows(x, dtype, group)
    out = []
    for layout in ("block", "channel"):
        weights = fp8_moe.expert_weights(TINY, (128, 128) if layout == "block" else None, "cpu", torch.float16)
        fp8_moe.add_copies(weights, 2)
        used = set()

        def timer(run):  # a call per weight copy, the copies the run was handed
            for i in range(2):
                used.add(i)
                run(i)
            return 1.0 + len(used)
        s = fp8_moe.measure(TOKENS, layout, TINY, weights, timer, bw=1e9, cands=CANDS, act_dtype=torch.float16)
        s["copies_used"] = sorted(used)
        s["table"] = fp8_moe.table([s])
        out.append(s)
    print(json.dumps(out))


def test_sweep_plumbing_in_interpreter():
    summaries = json.loads(run_under_interpreter("tests.benchmarks.test_fp8_moe", timeout=600).strip().splitlines()[-1])
    for s in summaries:
        assert s["current_us"] is not None and s["best_us"] is not None and s["bf16_us"] is not None, s["table"]
        assert s["copies_used"] == [0, 1]
        stages = [r["stage"] for r in s["rows"]]
        assert stages == ["current"] + ["w13"] * len(CANDS) + ["w2"] * len(CANDS)
        bad = [r for r in s["rows"] if r["us"] is None]
        assert len(bad) == s["not_timed"] == 2  # the BLOCK_N 24 plan of each GEMM, reported
        assert {r["plan"]["BLOCK_N1"] if r["stage"] == "w13" else r["plan"]["BLOCK_N2"] for r in bad} == {24}
        w2_rows = [r for r in s["rows"] if r["stage"] == "w2"]
        assert all(r["plan"]["BLOCK_N1"] in (16, 32) for r in w2_rows)  # the w13 GEMM's best, kept
        assert s["best_plan"]["BLOCK_N1"] in (16, 32, 64) and s["best_plan"]["BLOCK_N2"] in (16, 32, 64)
        h, i, e = TINY["hidden"], TINY["inter"], TINY["experts"]
        scales = (2 * i // 128) * (h // 128) + (h // 128) * (i // 128) if s["layout"] == "block" else 2 * i + h
        assert s["bytes"] == s["active_experts"] * (3 * h * i + 4 * scales)
        assert 2 <= s["active_experts"] <= min(e, TOKENS * TINY["top_k"])
        assert s["floor_us"] == s["bytes"] / 1e9 * 1e6
        assert len(s["table"].splitlines()) == 2 and "w13 " in s["table"]


def test_candidates_cover_the_grid():
    cands = fp8_moe.gemm_candidates()
    assert {bn for bn, _, _ in cands} == {16, 32, 64, 128} and {s for _, _, s in cands} == {2, 3, 4, 5}
    assert {w for _, w, _ in cands} == {1, 2, 4} and len(cands) == len(set(cands)) == 36


if __name__ == "__main__":
    _child()

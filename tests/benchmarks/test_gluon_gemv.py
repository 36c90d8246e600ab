"""benchmarks.gluon_gemv: its Gluon kernel compiles for sm_90 to TMA copies and wgmma, with the weight tiles
requested before the PDL wait and the activation tiles after it; on a Hopper GPU it gives fp8_linear_ref's
result. No timing. (Gluon has no interpreter: the numbers are checked on a GPU only.)"""
import pytest
import torch

from tests.fp8_gpu import hopper_block_case

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")


def _ptx(split: int, stages: int, pdl: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.gluon_gemv import BK, BM, BN, TensorDescriptor, gemv_tma_kernel, layouts
    wl, xl = layouts()
    w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    x = torch.empty(BM, 4096, dtype=torch.float8_e4m3fn)
    sig = {"w_desc": TensorDescriptor.from_tensor(w, [BN, BK], wl).__mangle__(),
           "x_desc": TensorDescriptor.from_tensor(x, [BM, BK], xl).__mangle__(),
           "xs_ptr": "*fp32", "ws_ptr": "*fp32", "part_ptr": "*fp32", "out_ptr": "*bf16", "ticket_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xs": "i32", "stride_ws": "i32",
           "SPLIT": "constexpr", "STAGES": "constexpr", "PDL": "constexpr", "num_warps": "constexpr"}
    consts = {"SPLIT": split, "STAGES": stages, "PDL": pdl, "num_warps": 4}
    return triton.compile(GluonASTSource(gemv_tma_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4)).asm["ptx"]


@pytest.mark.parametrize("split", [1, 4])
def test_compiles_to_tma_and_wgmma_with_weights_ahead_of_the_wait(split):
    ptx = _ptx(split, 4, pdl=True)
    copies = [i for i in range(len(ptx)) if ptx.startswith("cp.async.bulk.tensor", i)]
    wait = ptx.index("griddepcontrol.wait")
    assert "wgmma.mma_async" in ptx
    assert copies[0] < wait < copies[-1]  # weight tiles before the wait, activation tiles after
    assert ("atom.global" in ptx or "atom.acq_rel" in ptx) == (split > 1)  # the split-K ticket
    assert "griddepcontrol" not in _ptx(split, 4, pdl=False)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, split, stages, pdl", [(1, 4096, 4096, 4, 4, False), (16, 6144, 4096, 1, 8, True),
                                                        (5, 4096, 14336, 8, 4, True)])
def test_matches_reference_gpu(m, n, k, split, stages, pdl):
    _, w, ws, x = hopper_block_case(m, n, k)
    from benchmarks.gluon_gemv import gemv_tma
    from tandem.kernels.fp8 import E4M3, fp8_linear_ref, quantize_rows
    xq, xs = quantize_rows(x, E4M3, 128)
    tickets = torch.zeros(n // 128, device="cuda", dtype=torch.int32)
    ref = fp8_linear_ref(x, w, ws, (128, 128)).float()
    for _ in range(2):  # the tickets are back to zero after a launch
        got = gemv_tma(xq, xs, w, ws, tickets, split, stages, pdl).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert not tickets.any()

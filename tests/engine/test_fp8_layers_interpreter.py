"""FP8 linear layers hand the pending RMSNorm along on the FP8 decode tile, checked on CPU in
Triton's interpreter: o_proj (row-parallel, norm_after) -> PendingRMSNorm -> qkv, per-channel
(quantized at load) and block-scaled [128, 128] (checkpoint layout; qkv's 192 rows keep a scale per row),
against fp8_linear_ref + rms_norm_ref, and the same layers with fuse_norms off; and both again
with KernelConfig.fp8_dense_w8a16, where these decode row counts read the fp8 weights into the bf16
skinny GEMM (against fp8_linear_w8a16_ref).

The child process makes the kernels' dispatch take the Triton path for CPU tensors (the
interpreter runs them) and quantizes activations with the torch reference (the interpreter's
e4m3 cast misrounds: tests/kernels/test_fp8.py). On a GPU, tests/engine/test_fp8_gpu.py runs
the real path through the engine, and test_fp8_layers_pending_norm_gpu these layers.
"""
import json

import pytest
import torch

from tests.interpreter import run_under_interpreter

SCHEMES = ["channel", "block"]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _layers(scheme_name: str, fuse_norms: bool, device: str, act: torch.dtype, w8a16: bool = True):
    from torch import nn

    from tandem.engine.layers.fp8 import quantize_layers
    from tandem.engine.layers.linear import QKVParallelLinear, RowParallelLinear
    from tandem.engine.layers.norm import PendingRMSNorm
    from tandem.engine.quantization import Fp8Scheme
    from tandem.kernels import KernelConfig
    from tandem.kernels.fp8 import E4M3, quantize_weight

    kernels = KernelConfig(pdl=False, fuse_norms=fuse_norms, fp8_dense_w8a16=w8a16)
    model = nn.Module()
    model.o_proj = RowParallelLinear(256, 128, kernels=kernels, norm_after=True)
    model.norm = PendingRMSNorm(128, 1e-6, kernels=kernels)
    model.qkv_proj = QKVParallelLinear(128, 24, 4, 2, kernels=kernels)  # 192 rows: block scales stay rows
    block = (128, 128) if scheme_name == "block" else None
    scheme = Fp8Scheme(block, "weight_scale_inv") if block else Fp8Scheme(None, "", online=True)
    assert quantize_layers(model, scheme) == 2
    model.to(device)  # (loaded and processed where it runs: e4m3fnuz on MI300)
    g = torch.Generator().manual_seed(1)
    for layer in (model.o_proj, model.qkv_proj):
        w = torch.randn(layer.weight.shape, generator=g) * 0.05
        if block:  # the checkpoint's fp8 weight and its block scales, held as rows while loading
            q, s = quantize_weight(w, E4M3, block)
            layer.weight.data.copy_(q)
            layer.weight_scale_inv.data.copy_(s.repeat_interleave(block[0], 0)[:w.shape[0]])
        else:
            layer.weight = nn.Parameter(w.to(act).to(device), requires_grad=False)
        layer.process_weights_after_loading()
    model.norm.weight.data = (1 + 0.3 * torch.randn(128, generator=g)).to(act).to(device)
    return model


def run_case(scheme_name: str, device: str = "cpu") -> None:
    from tandem.kernels.fp8 import fp8_linear_ref, fp8_linear_w8a16_ref
    from tandem.kernels.linear import PendingNorm
    from tandem.kernels.norm import rms_norm_ref

    act = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 dot is wrong)
    for fuse, w8a16 in ((True, True), (False, True), (True, False), (False, False)):
        model = _layers(scheme_name, fuse, device, act, w8a16)
        ref = fp8_linear_w8a16_ref if w8a16 else fp8_linear_ref
        o, qkv = model.o_proj, model.qkv_proj
        g = torch.Generator().manual_seed(2)
        for rows in (1, 5):
            x = torch.randn(rows, 256, generator=g).to(act).to(device)
            res = torch.randn(rows, 128, generator=g).to(act).to(device)
            h, s = model.norm(o(x), res)
            assert isinstance(h, PendingNorm) == fuse, (scheme_name, fuse)
            y = qkv(h)
            s_ref = (ref(x.float(), o.weight, o.weight_scale, o.fp8_block).to(act).float() + res.float())
            y_ref = ref(rms_norm_ref(s_ref.to(act), model.norm.weight, 1e-6).float(), qkv.weight,
                        qkv.weight_scale, qkv.fp8_block)
            assert _rel(s, s_ref) < 1e-2, (scheme_name, fuse, w8a16, rows, _rel(s, s_ref))
            assert _rel(y, y_ref) < 2e-2, (scheme_name, fuse, w8a16, rows, _rel(y, y_ref))


def _main() -> None:
    import tandem.kernels.fp8 as fp8
    import tandem.kernels.linear as linear
    from tandem.kernels.triton import fp8 as triton_fp8
    from tandem.kernels.triton import fp8_skinny

    linear.use_triton = fp8.use_triton = lambda t: True  # the interpreter runs the Triton path on CPU
    fp8.has_fp8_compute = lambda device: True
    triton_fp8.quantize_rows_triton = fp8_skinny.quantize_rows_triton = (
        lambda x, dtype, group, pdl=False: fp8.quantize_rows(x, dtype, group))
    plan = fp8_skinny.default_plan
    fp8_skinny.default_plan = lambda *a, **kw: dict(plan(*a, **kw), QUANT=False)
    results = {}
    for name in SCHEMES:
        try:
            run_case(name)
            results[name] = ""
        except Exception as exc:  # reported per case by the parent
            results[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    stdout = run_under_interpreter("tests.engine.test_fp8_layers_interpreter", timeout=600)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_layers_pending_norm_in_interpreter(interpreter_results, scheme):
    assert interpreter_results[scheme] == "", interpreter_results[scheme]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_layers_pending_norm_gpu(scheme):
    """The same on a GPU with FP8: the real dispatch, the kernels quantizing in the GEMM."""
    from tandem.kernels.fp8 import has_fp8_compute
    if not torch.cuda.is_available() or not has_fp8_compute(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8")
    run_case(scheme, "cuda")


if __name__ == "__main__":
    _main()

"""The norm handoff between layers (engine/layers/norm.py) on the CPU, against the plain
reference: rms_norm(x + residual) then the matmul. The GPU kernels behind it are tested in
tests/kernels (test_triton_interpreter.py, test_triton.py); here, what the layers do with a
DeferredOutput and a PendingNorm."""
import torch

from tandem.engine.layers.linear import ReplicatedLinear, RowParallelLinear
from tandem.engine.layers.norm import DeferredOutput, PendingRMSNorm, RMSNorm
from tandem.kernels import KernelConfig
from tandem.kernels.linear import PendingNorm
from tandem.kernels.norm import rms_norm_ref

K = KernelConfig()


def _layers(h: int = 32, n: int = 24):
    torch.manual_seed(0)
    row = RowParallelLinear(n, h, kernels=K, norm_after=True)
    norm = PendingRMSNorm(h, 1e-6, kernels=K)
    after = ReplicatedLinear(h, n, kernels=K)
    for p in (row.weight, norm.weight, after.weight):
        p.data.normal_()
    return row, norm, after


def test_deferred_output_falls_back_to_the_norm_launch():
    """On the CPU the GEMM ahead cannot carry the norm: the norm computes the deferred output,
    adds the residual and normalizes, as the reference does."""
    row, norm, after = _layers()
    x, residual = torch.randn(3, 24), torch.randn(3, 32)
    out = row(x)
    assert isinstance(out, DeferredOutput)
    hidden, new_residual = norm(out, residual)
    s = x @ row.weight.t() + residual
    assert torch.allclose(new_residual, s, atol=1e-5)
    assert torch.allclose(hidden, rms_norm_ref(s, norm.weight, 1e-6), atol=1e-5)
    assert torch.allclose(after(hidden), hidden @ after.weight.t(), atol=1e-5)


def test_pending_norm_is_applied_by_the_next_linear_layer():
    """A DeferredOutput that carries the norm returns a PendingNorm and the new residual; the
    linear layer after it applies the norm (here through PendingNorm.normed, the CPU path)."""
    row, norm, after = _layers()
    s, residual = torch.randn(3, 32), torch.randn(3, 32)
    pending = PendingNorm(s, s * norm.weight, torch.zeros(16, 1), norm.weight, norm.eps)
    calls = []

    def add_norm(res, n):
        calls.append((res, n))
        return pending

    hidden, new_residual = norm(DeferredOutput(lambda: None, add_norm), residual)
    assert hidden is pending and new_residual is s and calls == [(residual, norm)]
    ref = rms_norm_ref(s, norm.weight, 1e-6) @ after.weight.t()
    assert torch.allclose(after(hidden), ref, atol=1e-5)


def test_plain_rmsnorm_never_leaves_a_norm_pending():
    """The final norm (its consumer, the LM head, takes rows) computes a deferred output."""
    row, _, _ = _layers()
    final = RMSNorm(32, 1e-6, kernels=K)
    x, residual = torch.randn(2, 24), torch.randn(2, 32)
    hidden, s = final(row(x), residual)
    assert isinstance(hidden, torch.Tensor)
    assert torch.allclose(hidden, rms_norm_ref(x @ row.weight.t() + residual, final.weight, 1e-6), atol=1e-5)

"""Linear layers that shard their weights over the tensor-parallel group.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies
this rank's slice of a checkpoint tensor into it, so fused projections (qkv,
gate_up) load from the separate tensors a Hugging Face checkpoint stores.

Every layer holds the engine's KernelConfig (given at construction) and passes it to the
kernels. A layer's input may be a PendingNorm (rms_norm of the rows still to apply: see
engine/layers/norm.py), which the GEMM applies in its epilogue.
"""
import torch
from torch import nn

from tandem.engine.layers.norm import DeferredOutput, RMSNorm
from tandem.engine.parallel import tp_all_reduce, tp_rank, tp_size
from tandem.kernels import KernelConfig
from tandem.kernels.linear import PendingNorm, linear, linear_add_norm, linear_normed


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None, *,
                 kernels: KernelConfig):
        super().__init__()
        self.kernels = kernels
        self.tp_dim = tp_dim  # 0: output rows sharded, 1: input columns sharded, None: replicated
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if self.tp_dim is None or tp_size() == 1 or (self.tp_dim == 1 and loaded.dim() == 1):
            return loaded
        size = param.shape[self.tp_dim]
        return loaded.narrow(self.tp_dim, tp_rank() * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, self._shard(param, loaded), "linear")

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """x: [T, in] (or a PendingNorm of [T, in] rows) -> [T, out]."""
        if isinstance(x, PendingNorm):
            return linear_normed(x, self.weight, self.bias, self.kernels)
        return linear(x, self.weight, self.bias, self.kernels)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, kernels: KernelConfig):
        super().__init__(in_features, out_features, bias, None, kernels=kernels)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, kernels: KernelConfig):
        super().__init__(in_features, _divide(out_features, tp_size()), bias, 0, kernels=kernels)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up); shard_id = index of the part."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, *, kernels: KernelConfig):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, kernels=kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        tp = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        src = loaded.narrow(0, tp_rank() * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src, f"part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; shard_id in {"q", "k", "v"}. KV heads are
    replicated when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 kernels: KernelConfig):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, kernels=kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, rank = {"q": (0, q_size, tp_rank()),
                              "k": (q_size, kv_size, tp_rank() // self.kv_replicas),
                              "v": (q_size + kv_size, kv_size, tp_rank() // self.kv_replicas)}[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size), f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """Input columns sharded; partial outputs summed over the group (bias added once).

    norm_after: the output feeds an RMSNorm with a residual (o_proj, down_proj): forward returns a
    DeferredOutput, so that a PendingRMSNorm can have this GEMM add the residual and leave the
    norm pending (engine/layers/norm.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, kernels: KernelConfig,
                 norm_after: bool = False):
        super().__init__(_divide(in_features, tp_size()), out_features, bias, 1, kernels=kernels)
        self.norm_after = norm_after

    def forward(self, x: torch.Tensor) -> torch.Tensor | DeferredOutput:
        """x: [T, in / tp] -> [T, out], or its DeferredOutput with norm_after."""
        if self.norm_after:
            return DeferredOutput(lambda: self._compute(x), lambda residual, norm: self._add_norm(x, residual, norm))
        return self._compute(x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if tp_rank() == 0 else None, self.kernels)
        return tp_all_reduce(y)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> PendingNorm | None:
        """This layer's output + residual with `norm` left pending for the next GEMM
        (kernels.linear.linear_add_norm), or None where that does not apply (no GPU, more rows,
        fuse_norms off, a bias, tensor parallel: the all-reduce comes before the add)."""
        if tp_size() > 1 or self.bias is not None:
            return None
        return linear_add_norm(x, self.weight, residual, norm.weight, norm.eps, self.kernels)

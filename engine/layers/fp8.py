"""FP8 linear and MoE layers: the bf16 layer classes with fp8 weights and the scales beside them.

`quantize_layers(model, scheme)` runs once on a freshly built model, before its weights load: each
linear layer or MoE block the scheme covers becomes its FP8 variant (a subclass of its own class,
made once per class, as torch.nn.utils.parametrize does), which owns an fp8 `weight` (w13/w2) and
its float32 scales and loads them from the checkpoint's tensors through the same sharding as the
bf16 weight. MoE router gates stay bf16 (both published formats keep them so).

While loading, a block-scaled weight's scales are held one row per output row ([N, Kb]; fused
q/k/v and gate/up parts then need not start on a block boundary); per-tensor scales are expanded
to rows. `process_weights_after_loading` folds rows back into blocks where the parts allow,
quantizes online (`--quantization fp8`), and converts to e4m3fnuz on MI300.
"""
import functools
import logging

import torch
from torch import nn

from tandem.engine.layers.linear import LinearBase
from tandem.engine.layers.moe import FusedMoE
from tandem.engine.parallel import tp_all_reduce, tp_rank, tp_size
from tandem.engine.quantization import Fp8Scheme, fp8_scheme
from tandem.engine.layers.norm import DeferredOutput, next_quant, next_router
from tandem.kernels.ep import NoDispatch
from tandem.kernels.fp8 import (E4M3, QuantRows, e4m3fn_to_fnuz, fold_router, fp8_decode_rows, fp8_dtype,
                               fp8_linear, fp8_linear_add_norm, fp8_linear_normed, fused_experts_fp8, quant_ahead,
                               quantize_weight, ring_experts, ring_router, takes_partials, tma_early)
from tandem.kernels.linear import PendingNorm

logger = logging.getLogger(__name__)


def _fp8_param(shape, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=E4M3, device=device), requires_grad=False)


def _scale_param(shape, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)
    p.is_fp8_scale = True  # (loader.init_dummy_weights gives it a plausible value)
    return p


def _rows(loaded: torch.Tensor, rows: int, bn: int | None) -> torch.Tensor:
    """A checkpoint scale as one row per output row: [rows] (per-channel / per-tensor, bn None) or
    [rows, Kb] (block grid [ceil(rows / bn), Kb])."""
    loaded = loaded.float()
    if bn is None:
        if loaded.numel() == 1:
            return loaded.reshape(1).expand(rows)
        return loaded.reshape(-1)
    return loaded.repeat_interleave(bn, dim=0)[:rows]


def _fold_rows(scale: torch.Tensor, bn: int) -> tuple[torch.Tensor, int]:
    """[..., N, Kb] row scales -> ([..., N / bn, Kb], bn) where every bn rows agree, else (scale, 1)."""
    n = scale.shape[-2]
    if bn > 1 and n % bn == 0:
        folded = scale.unflatten(-2, (n // bn, bn))
        if torch.equal(folded, folded[..., :1, :].expand_as(folded)):
            return folded[..., 0, :].contiguous(), bn
    return scale, 1


def _to_platform(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dtype == E4M3 and fp8_dtype(w.device.type) == torch.float8_e4m3fnuz:
        return e4m3fn_to_fnuz(w, scale)
    return w, scale


class Fp8Linear:
    """Mixin over a LinearBase class: weight [N, K] fp8, weight_scale per kernels/fp8.py (block
    self.fp8_block)."""

    def fp8_init(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.fp8_block = None if scheme.block is None else (1, scheme.block[1])
        if scheme.online:
            return  # the bf16 weight loads, then quantizes
        n, k = self.weight.shape
        loader = self.weight.weight_loader
        self.weight = _fp8_param((n, k), self.weight.device)
        self.weight.weight_loader = loader
        shape = (n,) if scheme.block is None else (n, -(-k // scheme.block[1]))
        scale = _scale_param(shape, self.weight.device)
        scale.weight_loader = self.fp8_scale_loader
        self.register_parameter(scheme.scale_name, scale)

    def fp8_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim == 1 and self.scheme.block is not None and tp_size() > 1 and \
                self.weight.shape[1] % self.scheme.block[1]:
            raise ValueError(f"fp8: input size per rank {self.weight.shape[1]} is not a multiple of the "
                             f"weight block {self.scheme.block[1]}; use another --tensor-parallel-size")
        rows = param.shape[0] * (tp_size() if self.tp_dim == 0 else 1)
        bn = None if self.scheme.block is None else self.scheme.block[0]
        self.weight_loader(param, _rows(loaded, rows, bn), shard_id)

    def process_weights_after_loading(self) -> None:
        if self.scheme.online:
            w, scale = quantize_weight(self.weight.data)
        else:
            w, scale = self.weight.data, getattr(self, self.scheme.scale_name).data
            delattr(self, self.scheme.scale_name)
            if self.scheme.block is not None:
                scale, bn = _fold_rows(scale, self.scheme.block[0])
                self.fp8_block = (bn, self.scheme.block[1])
        w, scale = _to_platform(w, scale)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | DeferredOutput:
        """x: [T, in] or a PendingNorm of such rows (its norm applied by the FP8 GEMM at decode sizes)
        -> [T, out]; a row-parallel layer with norm_after (o_proj, down_proj) returns a DeferredOutput
        (engine/layers/norm.py), as the bf16 RowParallelLinear does."""
        if getattr(self, "norm_after", False):
            return DeferredOutput(lambda: self._fp8_compute(x), lambda res, norm: self._fp8_add_norm(x, res, norm))
        return self._fp8_compute(x)

    def _fp8_compute(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        row_parallel = self.tp_dim == 1 and tp_size() > 1
        bias = None if row_parallel and tp_rank() else self.bias
        if isinstance(x, PendingNorm):
            y = fp8_linear_normed(x, self.weight, self.weight_scale, self.fp8_block, bias, self.kernels)
        else:
            y = fp8_linear(x, self.weight, self.weight_scale, self.fp8_block, bias, self.kernels)
        return tp_all_reduce(y) if row_parallel else y

    def quant_ahead(self, x: torch.Tensor) -> tuple | None:
        """(fp8 dtype, group) where this layer's input rows x are better written quantized by the kernel
        producing them (kernels.fp8.quant_ahead), else None."""
        return quant_ahead(x, self.weight, self.fp8_block, self.kernels)

    def tma_early(self, x: torch.Tensor) -> bool:
        """Whether the kernel producing this layer's input rows x lets its launch in early (kernels.fp8.tma_early),
        where this layer runs as _fp8_add_norm would run it."""
        return (getattr(self, "norm_after", False) and self._may_add_norm()
                and tma_early(x, self.weight, self.fp8_block, self.kernels))

    def takes_partials(self, x: torch.Tensor) -> bool:
        """Whether the attention producing this layer's input rows x hands over its split-K partials, merged by this
        layer's TMA GEMM (kernels.fp8.takes_partials), where this layer runs as _fp8_add_norm would run it."""
        return (getattr(self, "norm_after", False) and self._may_add_norm()
                and takes_partials(x, self.weight, self.fp8_block, self.kernels))

    def _may_add_norm(self) -> bool:
        """Whether this layer may carry the norm after it (_fp8_add_norm): one rank (with tensor parallel the
        all-reduce comes before the add), no bias."""
        return tp_size() == 1 and self.bias is None

    def _fp8_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> PendingNorm | None:
        """This layer's output + residual with `norm` left pending for the next GEMM, or None (nothing
        run) where that does not apply (_may_add_norm; no GPU with FP8; more rows). x may be QuantRows (the TMA
        GEMM's ring form, kernels.fp8.tma_ring)."""
        if not self._may_add_norm() or isinstance(x, PendingNorm):
            return None
        return fp8_linear_add_norm(x, self.weight, self.weight_scale, self.fp8_block, residual, norm.weight,
                                   norm.eps, self.kernels, next_quant(norm, residual), next_router(norm, residual))


class Fp8FusedMoE:
    """Mixin over FusedMoE: w13 [E, 2I, H] and w2 [E, H, I] fp8, w13_scale / w2_scale per
    kernels/fp8.py (block self.fp8_block); the experts run kernels.fp8.fused_experts_fp8."""

    def fp8_init(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.fp8_block = None if scheme.block is None else (1, scheme.block[1])
        self.experts = self.fp8_experts
        if scheme.online:
            return
        for name in ("w13", "w2"):
            old = getattr(self, name)
            e, n, k = old.shape
            new = _fp8_param((e, n, k), old.device)
            new.weight_loader = self.weight_loader
            setattr(self, name, new)
            shape = (e, n) if scheme.block is None else (e, n, -(-k // scheme.block[1]))
            scale = _scale_param(shape, old.device)
            scale.weight_loader = self.fp8_scale_loader
            self.register_parameter(name + "_scale", scale)

    def fp8_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id (expert, part) as FusedMoE.weight_loader: part 0 gate, 1 up (w13), None (w2)."""
        if shard_id is None:
            raise ValueError("fp8 experts: scales stacked over all experts are not supported; "
                             "expected one scale tensor per expert and projection")
        expert, part = shard_id
        if expert not in self._local_index:
            return
        size, rank = self.intermediate_size, self.shard
        bn = None if self.scheme.block is None else self.scheme.block[0]
        dst = param.data[self._local_index[expert]]
        if part is not None:
            loaded = _rows(loaded, size * self.shards, bn).narrow(0, rank * size, size)
            dst = dst.narrow(0, part * size, size)
        else:
            loaded = _rows(loaded, dst.shape[0], bn)
            if bn is not None and self.shards > 1:
                bk = self.scheme.block[1]
                if size % bk:
                    raise ValueError(f"fp8 experts: intermediate size per rank {size} is not a multiple of "
                                     f"the weight block {bk}; use another --tensor-parallel-size")
                loaded = loaded.narrow(1, rank * size // bk, size // bk)
        if dst.shape != loaded.shape:
            raise ValueError(f"fp8 experts: checkpoint scale has shape {tuple(loaded.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        bns = []
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            if self.scheme.online:
                w, scale = quantize_weight(w)
            else:
                scale = getattr(self, name + "_scale").data
                if self.scheme.block is not None:
                    scale, bn = _fold_rows(scale, self.scheme.block[0])
                    bns.append(bn)
            w, scale = _to_platform(w, scale)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(scale, requires_grad=False))
        if bns and bns[0] != bns[1]:  # one block for both GEMMs: unfold the folded one
            self.w13_scale.data = self.w13_scale.data.repeat_interleave(bns[0], dim=-2)
            self.w2_scale.data = self.w2_scale.data.repeat_interleave(bns[1], dim=-2)
            bns = [1, 1]
        if bns:
            self.fp8_block = (bns[0], self.scheme.block[1])

    def _routed_here(self, x: torch.Tensor | PendingNorm) -> bool:
        """At decode sizes with every expert here (KernelConfig.fp8_moe_w8a16): the routed bf16 expert
        kernels reading the fp8 weights (W8A16), routing in the first GEMM and the norms fused as
        for bf16; else routing, then the FP8 experts."""
        rows = x.sg if isinstance(x, PendingNorm) else x
        return isinstance(self.dispatcher, NoDispatch) and fp8_decode_rows(rows, self.fp8_block, self.kernels,
                                                                           moe=True) > 0

    def _gate_in_experts(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | None:
        rows = x.sg if isinstance(x, PendingNorm) else x
        w = self.gate.weight
        if (self.gate.bias is None and self._routed_here(x)
                and ring_experts(rows, self.w13, self.w2, self._expert_scales, self.top_k, self.kernels)
                and ring_router(rows, w, self.kernels)):
            return w
        return None

    def router_ahead(self, rows: torch.Tensor) -> tuple | None:
        """(router weight, (dtype, group) of w13's input) where the GEMM producing this layer's input rows (one token
        with this layer's norm pending) may run the router GEMM in partials and quantize the row for the ring
        experts (kernels.fp8.fold_router), else None."""
        w = self._gate_in_experts(rows)
        if w is None or tp_size() > 1 or not fold_router(rows, w, self.kernels):
            return None
        return w, (self.w13.dtype, 128)

    @property
    def _expert_scales(self) -> tuple:
        return self.w13_scale, self.w2_scale, self.fp8_block

    def fp8_experts(self, x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        return fused_experts_fp8(x, w13, self.w13_scale, w2, self.w2_scale, topk_weights, topk_ids, self.fp8_block,
                                 self.kernels)


@functools.cache
def _fp8_class(cls: type, mixin: type) -> type:
    return type("Fp8" + cls.__name__, (mixin, cls), {})


def _checkpoint_name(name: str, module: nn.Module) -> str:
    """A checkpoint module name of ours (fused q/k/v and gate/up by their first part)."""
    if isinstance(module, FusedMoE):
        return name + ".experts"
    return name.replace(".qkv_proj", ".q_proj").replace(".gate_up_proj", ".gate_proj")


def quantize_layers(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Turn every linear layer and MoE block the scheme covers into its FP8 variant, in place
    (before weights load). Returns how many became FP8."""
    gates = {id(m.gate) for m in model.modules() if isinstance(m, FusedMoE)}
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            mixin = Fp8FusedMoE
        elif isinstance(module, LinearBase) and id(module) not in gates:
            mixin = Fp8Linear
        else:
            continue
        if scheme.ignores(_checkpoint_name(name, module)) or isinstance(module, (Fp8Linear, Fp8FusedMoE)):
            continue
        module.__class__ = _fp8_class(type(module), mixin)
        module.fp8_init(scheme)
        count += 1
    return count


def link_quantized_inputs(model: nn.Module) -> int:
    """Point each RMSNorm, attention or activation whose output only an FP8 linear layer reads (a decoder
    layer's norms ahead of qkv_proj and a dense gate_up_proj, the attention ahead of o_proj, the MLP's
    activation ahead of down_proj) at that layer's quant_ahead, so it writes the rows quantized where the
    layer would quantize them in a launch of its own (engine/layers/norm.py), and the attention at the o
    projection's tma_early (whether its split merge lets the o projection in early), and the post-attention norm
    ahead of FP8 MoE experts at their router_ahead (whether the o projection runs their router GEMM in partials).
    Returns how many quant_ahead links were made."""
    linked = 0
    for m in model.modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        for producer, consumer in ((getattr(m, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
                                   (getattr(m, "attn", None), getattr(m, "o_proj", None)),
                                   (getattr(m, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None)),
                                   (getattr(m, "post_attention_layernorm", None), mlp),
                                   (getattr(m, "act_fn", None), getattr(m, "down_proj", None))):
            if isinstance(consumer, Fp8Linear) and hasattr(producer, "quant_spec"):
                producer.quant_spec = consumer.quant_ahead  # a bound method: not a submodule of the producer
                linked += 1
            if (isinstance(consumer, Fp8FusedMoE) and hasattr(producer, "router_spec")
                    and consumer.kernels.fp8_tma_ring_moe_fold):  # (off: no per-step question asked)
                producer.router_spec = consumer.router_ahead
            if isinstance(consumer, Fp8Linear) and hasattr(producer, "early_spec"):
                producer.early_spec = consumer.tma_early
                producer.partials_spec = consumer.takes_partials
    return linked


def quantize_model(model: nn.Module, hf_config, quantization: str | None) -> Fp8Scheme | None:
    """Make the freshly built model's covered layers FP8, before loading; None if it has no FP8."""
    scheme = fp8_scheme(hf_config, quantization)
    if scheme is None:
        return None
    count = quantize_layers(model, scheme)
    link_quantized_inputs(model)
    logger.info("FP8: %d layers (%s, %s)", count, "quantized at load" if scheme.online else "checkpoint",
                f"block {list(scheme.block)}" if scheme.block else "per-channel")
    return scheme

"""Llama-family decoder (Llama, Qwen2, Qwen3): the dense models and the skeleton the MoE
models reuse with another MLP.

Differences within the family are config flags, not subclasses: Qwen2 has q/k/v
biases, Qwen3 normalizes q and k per head before the rotary embedding.
"""
from typing import Callable

import torch
from torch import nn

from tandem.engine.config import ParallelConfig
from tandem.engine.forward_context import ForwardContext
from tandem.engine.layers.attention import Attention
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.kernels import linear as kernels_linear
from tandem.kernels import silu_and_mul
from tandem.kernels.linear import PendingNorm, linear_normed


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg.hidden_size, o_bias)
        self.rotary_emb = RotaryEmbedding(cfg, self.head_dim, cfg.max_position_embeddings)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm, ctx: ForwardContext,
                then: tuple | None = None) -> torch.Tensor | PendingNorm:
        """Attention of x, normalized rows or a PendingNorm (whose norm the qkv GEMM applies).
        then = (residual, norm): where o_proj can, it returns its output plus the residual with
        that norm pending (kernels.linear.PendingNorm) instead."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = (linear_normed(x, self.qkv_proj.weight, self.qkv_proj.bias) if isinstance(x, PendingNorm)
               else self.qkv_proj(x))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        out = self.attn(q, k, v, ctx, positions, self.rotary_emb.cos_sin_cache, norm)
        if then is not None:
            pending = self.o_proj.forward_add_norm(out, *then)
            if pending is not None:
                return pending
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor | PendingNorm, then: tuple | None = None) -> torch.Tensor | PendingNorm:
        """The MLP of x, normalized rows or a PendingNorm (whose norm gate_up applies). then =
        (residual, norm): where down_proj can, its output plus the residual with that norm pending."""
        gate_up = (linear_normed(x, self.gate_up_proj.weight, self.gate_up_proj.bias) if isinstance(x, PendingNorm)
                   else self.gate_up_proj(x))
        act = silu_and_mul(gate_up)
        if then is not None:
            pending = self.down_proj.forward_add_norm(act, *then)
            if pending is not None:
                return pending
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, ctx, next_norm: RMSNorm | None = None):
        """-> (output, residual), or (PendingNorm, None) with next_norm (the next layer's input
        norm) left pending. At decode sizes on a GPU a norm rides on the GEMM ahead of it and the
        GEMM after it (kernels.linear.PendingNorm) instead of a launch of its own."""
        if isinstance(hidden, PendingNorm):  # the layer ahead left this layer's input norm pending
            x, residual = hidden, hidden.s
        elif residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        out = self.self_attn(positions, x, ctx, then=(residual, self.post_attention_layernorm))
        if isinstance(out, PendingNorm):
            x, residual = out, out.s
        else:
            x, residual = self.post_attention_layernorm(out, residual)
        out = self.mlp(x, None if next_norm is None else (residual, next_norm))
        return out, None if isinstance(out, PendingNorm) else residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, make_layer: Callable[[int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, ctx):
        hidden, residual = self.embed_tokens(input_ids), None
        pend_input = kernels_linear.FOLD_INPUT_NORM
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if pend_input and i + 1 < len(self.layers) else None
            hidden, residual = layer(positions, hidden, residual, ctx, next_norm)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A decoder plus LM head; subclasses say how to build a layer and how checkpoint names map."""

    # checkpoint name fragment -> (our fragment, shard id) for fused parameters
    packed_modules = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg, parallel: ParallelConfig):
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.model = DecoderModel(cfg, self.make_layer)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, i: int) -> DecoderLayer:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (our parameter name, shard id), or None to skip it."""
        if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        for frag, (ours, shard) in self.packed_modules.items():
            if frag in name:
                return name.replace(frag, ours), shard
        return name, None


class LlamaForCausalLM(CausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg = self.config
        bias = getattr(cfg, "attention_bias", False)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, bias, bias, qk_norm=False),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False)))


class Qwen2ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg = self.config
        return DecoderLayer(cfg, LlamaAttention(cfg, i, qkv_bias=True, o_bias=False, qk_norm=False),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size))


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg = self.config
        bias = getattr(cfg, "attention_bias", False)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, bias, bias, qk_norm=True),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size))

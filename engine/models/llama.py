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
from tandem.engine.layers.activation import SiluAndMul
from tandem.engine.layers.attention import Attention
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.engine.layers.norm import PendingRMSNorm, RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.kernels import KernelConfig


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, *, kernels: KernelConfig):
        super().__init__()
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias,
                                          kernels=kernels)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg.hidden_size, o_bias, kernels=kernels,
                                        norm_after=True)
        self.rotary_emb = RotaryEmbedding(cfg, self.head_dim, cfg.max_position_embeddings)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              kernels=kernels)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels=kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels=kernels)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """positions: [T]; hidden: [T, H] -> [T, H]. q and k are normalized per head (Qwen3),
        rotated and stored with v by the attention layer."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        out = self.attn(q, k, v, ctx, positions, self.rotary_emb.cos_sin_cache, norm)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, kernels: KernelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, kernels=kernels, norm_after=True)
        self.act_fn = SiluAndMul(kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, attn: nn.Module, mlp: nn.Module, *, kernels: KernelConfig):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        # between two GEMMs: at decode sizes on a GPU the GEMMs carry them (engine/layers/norm.py)
        self.input_layernorm = PendingRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels=kernels)
        self.post_attention_layernorm = PendingRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels=kernels)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: [T, H] (residual None for the first layer) -> (output, residual)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, make_layer: Callable[[int], DecoderLayer], *, kernels: KernelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels=kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A decoder plus LM head; subclasses say how to build a layer and how checkpoint names map."""

    # checkpoint name fragment -> (our fragment, shard id) for fused parameters
    packed_modules = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg, parallel: ParallelConfig, kernels: KernelConfig):
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.kernels = kernels
        self.model = DecoderModel(cfg, self.make_layer, kernels=kernels)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, kernels=kernels)
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
        cfg, kernels = self.config, self.kernels
        bias = getattr(cfg, "attention_bias", False)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, bias, bias, qk_norm=False, kernels=kernels),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False),
                                     kernels=kernels), kernels=kernels)


class Qwen2ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg, kernels = self.config, self.kernels
        return DecoderLayer(cfg, LlamaAttention(cfg, i, qkv_bias=True, o_bias=False, qk_norm=False, kernels=kernels),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels), kernels=kernels)


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg, kernels = self.config, self.kernels
        bias = getattr(cfg, "attention_bias", False)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, bias, bias, qk_norm=True, kernels=kernels),
                            LlamaMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels), kernels=kernels)

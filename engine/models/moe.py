"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama skeleton with FusedMoE MLPs."""
import re

from tandem.engine.layers.moe import FusedMoE
from tandem.engine.models.llama import CausalLM, DecoderLayer, LlamaAttention, LlamaMLP

_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv|weight_scale)$")
# Per-expert checkpoint projection -> (our stacked parameter, part of w13: 0 gate, 1 up; None for w2)
_EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
                 "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


class MoECausalLM(CausalLM):
    def map_checkpoint_name(self, name: str):
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
        m = _EXPERT.search(name)
        if m:
            ours, part = _EXPERT_PARTS[m.group(2)]
            suffix = "" if m.group(3) == "weight" else "_scale"  # fp8 checkpoints (engine/layers/fp8.py)
            return name[:m.start()] + "." + ours + suffix, (int(m.group(1)), part)
        if name.endswith(".experts.gate_up_proj"):  # transformers 5 fused layout, all experts
            return name.replace(".experts.gate_up_proj", ".w13"), None
        if name.endswith(".experts.down_proj"):
            return name.replace(".experts.down_proj", ".w2"), None
        return super().map_checkpoint_name(name)


class Qwen3MoeForCausalLM(MoECausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg, kernels = self.config, self.kernels
        sparse = (i not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
                  and (i + 1) % cfg.decoder_sparse_step == 0)
        mlp = (FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                        cfg.norm_topk_prob, self.parallel, kernels=kernels)
               if sparse else LlamaMLP(cfg.hidden_size, cfg.intermediate_size, kernels=kernels))
        bias = getattr(cfg, "attention_bias", False)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, bias, bias, qk_norm=True, kernels=kernels), mlp,
                            kernels=kernels)


class MixtralForCausalLM(MoECausalLM):
    def make_layer(self, i: int) -> DecoderLayer:
        cfg, kernels = self.config, self.kernels
        mlp = FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                       True, self.parallel, kernels=kernels)
        return DecoderLayer(cfg, LlamaAttention(cfg, i, False, False, qk_norm=False, kernels=kernels), mlp,
                            kernels=kernels)

"""Rotary embedding module: inverse frequencies from the HF config (any rope type that
transformers defines statically), cos/sin cached per position."""
import torch
from torch import nn

from tandem.kernels import apply_rotary, build_cos_sin_cache


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x layout
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": hf_config.rope_theta}
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        params = rope_parameters(hf_config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = 1.0
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        elif rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' (NTK scaling that changes with length) is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unknown rope_type {rope_type!r} in the model config")
            if hasattr(hf_config, "to_transformers"):  # (our ModelConfig: transformers' functions want theirs)
                hf_config = hf_config.to_transformers()
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        # transformers computes inv_freq on the CPU; the cache lives where the model is built.
        inv_freq = inv_freq.to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(inv_freq, max_positions, scaling),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)

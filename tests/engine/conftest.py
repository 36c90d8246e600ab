"""Tiny random models of each supported architecture, saved once per session with transformers."""
import pytest
import torch
import transformers

_COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)

ARCHS = {
    "llama": (transformers.LlamaConfig, dict(intermediate_size=128, architectures=["LlamaForCausalLM"],
                                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 128})),
    "qwen2": (transformers.Qwen2Config, dict(intermediate_size=128, architectures=["Qwen2ForCausalLM"],
                                             tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(intermediate_size=128, head_dim=32, architectures=["Qwen3ForCausalLM"])),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                                                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                                    mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                                 architectures=["MixtralForCausalLM"])),
}


def build_tiny_model(arch: str, path, seed: int = 0):
    cfg_cls, extra = ARCHS[arch]
    cfg = cfg_cls(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init leaves some weights at exactly zero/one (norms); perturb so every path matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (folder, transformers model)} for every supported architecture."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (str(path), build_tiny_model(arch, path))
    return out

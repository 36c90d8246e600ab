"""Model registry: Hugging Face `architectures` name -> our implementation."""
from tandem.engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from tandem.engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")

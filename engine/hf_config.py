"""config.json -> the model config the engine reads, without transformers.

transformers' config classes import torch.distributed.tensor, accelerate and sympy on first use
(transformers 5): about 4 s of every engine process's start-up, for one JSON file. `ModelConfig`
is config.json's keys as attributes, over the defaults that the family's transformers config
class gives the fields our models read (tests/engine/test_hf_config.py checks them against
transformers); `to_transformers()` builds transformers' own config where a transformers function
needs one (rope types other than the default)."""
import json
from pathlib import Path


def _head_dim(c: dict) -> int:
    return c["hidden_size"] // c["num_attention_heads"]


def _all_heads(c: dict) -> int:
    return c["num_attention_heads"]


# Each family's transformers defaults (transformers 5) for the fields the engine reads; a callable
# derives the field from the others when config.json leaves it out or null, as transformers does.
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=_all_heads, head_dim=_head_dim, vocab_size=32000, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=None),
    "qwen3": dict(hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, head_dim=128, vocab_size=151936, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                  eos_token_id=None),
    "qwen3_moe": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[], eos_token_id=None),
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=None, vocab_size=32000, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
}
# transformers' attribute_map: a second name for a field (either may be in config.json)
ALIASES = {"qwen3_moe": ("num_local_experts", "num_experts"), "mixtral": ("num_experts", "num_local_experts")}


class ModelConfig:
    """config.json's keys as attributes (families we know: over their defaults). `rope_parameters`
    is always set, as transformers 5 sets it: the rope fields (rope_parameters, or rope_scaling and
    rope_theta) in one dict with its `rope_type`."""

    def __init__(self, model_dir: str, values: dict):
        self.model_dir = model_dir
        family = values.get("model_type")
        c = {"architectures": None, **values}
        if family in ALIASES:
            alias, name = ALIASES[family]
            if alias in c and name not in c:
                c[name] = c.pop(alias)
        for key, default in FAMILY_DEFAULTS.get(family, {}).items():  # (derived ones after what they derive from)
            if key not in c:
                c[key] = default(c) if callable(default) else default
            elif c[key] is None and callable(default):  # null: derived, as transformers does
                c[key] = default(c)
        if family in ALIASES:
            c[ALIASES[family][0]] = c[ALIASES[family][1]]
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope.setdefault("rope_theta", c.pop("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        c["rope_parameters"] = c["rope_scaling"] = rope
        self.__dict__.update(c)

    def to_transformers(self):
        """transformers' config of the same folder (imports transformers: seconds)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir)

    def __repr__(self) -> str:
        return f"ModelConfig({self.model_dir!r}, model_type={getattr(self, 'model_type', None)!r})"


def load_hf_config(model_dir: str) -> ModelConfig:
    """The model folder's config.json (FileNotFoundError / ValueError saying what is wrong)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face model folder "
                                f"(config.json, *.safetensors, tokenizer files)")
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{path}: a Hugging Face model config needs a 'model_type' key")
    return ModelConfig(model_dir, values)

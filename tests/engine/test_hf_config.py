"""Our config.json reader (engine/hf_config.py) gives the engine the values transformers' config
classes give. Reference: transformers' AutoConfig on the same folder, field by field, for every
field the defaults table names (and the rope parameters), on configs that leave every field to
the defaults, on the forms a published config.json takes (rope scaling, rope_parameters, nulls, the
experts' second name, a dtype) and on the tiny test models; and the rotary embedding built from
each. The engine core builds its model without importing transformers."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from tandem.engine.hf_config import ALIASES, FAMILY_DEFAULTS, ModelConfig, load_hf_config
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.model_runner import resolve_dtype

MISSING = object()

CASES = {f"{family} defaults": {"model_type": family} for family in FAMILY_DEFAULTS} | {
    "llama 3.1 rope": {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 131072,
                       "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "linear rope, old 'type' key": {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope_parameters (transformers 5)": {"model_type": "qwen3",
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "nulls derived": {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                      "num_key_value_heads": None, "head_dim": None},
    "mixtral's num_experts": {"model_type": "mixtral", "num_experts": 4},
    "qwen3_moe's num_local_experts": {"model_type": "qwen3_moe", "num_local_experts": 4, "mlp_only_layers": [0]},
    "dtype": {"model_type": "qwen2", "torch_dtype": "bfloat16", "tie_word_embeddings": True},
}


def _write(tmp_path, values: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(values))
    return str(tmp_path)


def _assert_same_fields(ours: ModelConfig, theirs) -> None:
    family = ours.model_type
    names = set(FAMILY_DEFAULTS[family]) | set(ALIASES.get(family, ())) | {"rope_parameters", "architectures"}
    for name in sorted(names):
        assert getattr(ours, name, MISSING) == getattr(theirs, name, MISSING), name
    device = torch.device("cuda")  # (resolve_dtype reads the config's dtype off the CPU)
    assert resolve_dtype("auto", ours, device) == resolve_dtype("auto", theirs, device)


@pytest.mark.parametrize("case", CASES)
def test_fields_match_transformers(case, tmp_path):
    folder = _write(tmp_path, CASES[case])
    _assert_same_fields(load_hf_config(folder), AutoConfig.from_pretrained(folder))


def test_tiny_models_match_transformers(tiny_models):
    for folder, _ in tiny_models.values():
        _assert_same_fields(load_hf_config(folder), AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("case", ["llama defaults", "llama 3.1 rope", "linear rope, old 'type' key"])
def test_rotary_embedding_matches_transformers_config(case, tmp_path):
    folder = _write(tmp_path, CASES[case] | {"hidden_size": 256, "num_attention_heads": 4})
    ours = RotaryEmbedding(load_hf_config(folder), 64, 256).cos_sin_cache
    theirs = RotaryEmbedding(AutoConfig.from_pretrained(folder), 64, 256).cos_sin_cache
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("text,error", [("{not json", "not valid JSON"), ("[1, 2]", "model_type"),
                                        ('{"hidden_size": 8}', "model_type")])
def test_bad_config_json_is_a_clear_error(text, error, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=error):
        load_hf_config(str(tmp_path))


CHILD = """
import sys
from tandem.engine import LLM
LLM(max_model_len=64, num_gpu_blocks_override=16)
print("transformers" in sys.modules)
"""


def test_engine_starts_without_importing_transformers():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"

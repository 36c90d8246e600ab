"""benchmarks.dummy_model's --fp8 block and --layers: the folder's config is the shape's with the
block-scaled FP8 quantization_config (which the engine reads as the Hugging Face fine-grained
scheme) and the number of layers asked for; anything else stays the shape's. Reference:
benchmarks.roofline.MODELS and engine.quantization.fp8_scheme."""
import json

import pytest
from transformers import AutoConfig

from benchmarks.dummy_model import write_dummy_model
from benchmarks.roofline import MODELS
from tandem.engine.quantization import fp8_scheme


def test_fp8_block_config_with_fewer_layers(tmp_path):
    out = write_dummy_model("qwen3-30b-a3b", tmp_path / "m", fp8="block", layers=4)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    drop = ("num_hidden_layers", "quantization_config", "bos_token_id", "eos_token_id")
    shape = {k: v for k, v in MODELS["qwen3-30b-a3b"].items() if k not in drop}
    assert {k: v for k, v in config.items() if k not in drop} == shape
    scheme = fp8_scheme(AutoConfig.from_pretrained(out), None)
    assert scheme is not None and scheme.block == (128, 128) and scheme.scale_name == "weight_scale_inv"


def test_default_is_the_shape_unquantized(tmp_path):
    config = json.loads((write_dummy_model("llama3-8b", tmp_path / "m") / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == MODELS["llama3-8b"]["num_hidden_layers"]
    assert fp8_scheme(AutoConfig.from_pretrained(tmp_path / "m"), None) is None


def test_zero_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        write_dummy_model("llama3-8b", tmp_path / "m", layers=0)

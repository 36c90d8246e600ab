"""A bad model folder fails with a message naming the file and what was expected."""
import json
import shutil

import pytest

from tandem.engine import LLM, SamplingParams


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_missing_weights(tiny_models, tmp_path):
    d = _copy(tiny_models["llama"][0], tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d))


def test_unknown_architecture(tiny_models, tmp_path):
    d = _copy(tiny_models["llama"][0], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported: "):
        LLM(str(d))


def test_shape_mismatch_names_file_and_shapes(tiny_models, tmp_path):
    d = _copy(tiny_models["llama"][0], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .*mlp.*shape \((128, 64|64, 128)\), expected \((96, 64|64, 96)\)"):
        LLM(str(d))


def test_sharded_index_with_missing_shard(tiny_models, tmp_path):
    d = _copy(tiny_models["llama"][0], tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        LLM(str(d))


def test_sharded_checkpoint_loads(tiny_models, tmp_path):
    _, hf = tiny_models["mixtral"]
    d = tmp_path / "sharded"
    hf.save_pretrained(d, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").is_file()
    ref = LLM(tiny_models["mixtral"][0]).generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    out = LLM(str(d)).generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    assert out[0].token_ids == ref[0].token_ids


def test_dummy_load_format_needs_no_weights(tiny_models, tmp_path):
    d = tmp_path / "cfg_only"
    d.mkdir()
    shutil.copy(f"{tiny_models['qwen3_moe'][0]}/config.json", d / "config.json")
    out = LLM(str(d), load_format="dummy").generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4

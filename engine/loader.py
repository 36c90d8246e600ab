"""Hugging Face model folders -> weights (safetensors, single or sharded), or
random weights of the config's shape (load_format="dummy")."""
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tandem.engine.config import EngineConfig

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """--max-model-len, capped by the model's max_position_embeddings (2048 where it has none)."""
    max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
    return min(config.model.max_model_len or max_pos, max_pos)


def eos_token_ids(model_dir: str, hf_config) -> set[int]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    ids = None
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, list) else {ids}


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (use load_format='dummy' for random weights)")
    return files


# static activation / KV scales of FP8 checkpoints: activations are quantized per token at run time
# and the FP8 KV cache uses a scale of 1.0 (engine/quantization.py)
_UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


def _default_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: torch.nn.Module, model_dir: str) -> None:
    """Copy every checkpoint tensor into its parameter; every parameter must be covered."""
    params = dict(model.named_parameters())
    covered: set[str] = set()
    files = _safetensors_files(Path(model_dir))
    for file in tqdm(files, desc="Loading weights", unit="file", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = model.map_checkpoint_name(name)
                if target is None or name.endswith(_UNUSED_SUFFIXES):
                    continue
                pname, shard = target
                param = params.get(pname)
                if param is None:
                    raise ValueError(f"{file.name}: tensor {name!r} has no matching parameter in "
                                     f"{type(model).__name__} (is config.json's architecture right?)")
                try:
                    getattr(param, "weight_loader", _default_loader)(param, f.get_tensor(name).to(param.dtype), shard)
                except ValueError as e:
                    raise ValueError(f"{file.name}: tensor {name!r}: {e}") from e
                covered.add(pname)
    missing = sorted(set(params) - covered)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint has no tensors for {len(missing)} parameters, e.g. "
                         f"{', '.join(missing[:5])}")


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right shapes (performance work without downloads)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        if getattr(param, "is_fp8_scale", False):  # with the fp8 weights below, N(0, 0.02) overall
            param.data.fill_(_FP8_DUMMY_SCALE)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.dtype.itemsize == 1 and param.dtype.is_floating_point:
            tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            param.data.copy_(tmp.normal_(0.0, 0.02 / _FP8_DUMMY_SCALE, generator=gen).to(param.dtype))
            continue
        param.data.normal_(0.0, 0.02, generator=gen)


_FP8_DUMMY_SCALE = 0.02 / 16  # dummy fp8 weights of N(0, 16): within e4m3's range, N(0, 0.02) scaled

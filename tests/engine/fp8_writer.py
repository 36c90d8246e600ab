"""Our own FP8 checkpoint writer for tests: a saved bf16/fp32 Hugging Face folder rewritten in the
exact on-disk layout of a published FP8 format, plus the dequantized weights (the reference).

Formats:
  hf_block   Hugging Face fine-grained FP8: e4m3 `weight` + float32 `weight_scale_inv` per block,
             config `{"quant_method": "fp8", "weight_block_size": [bn, bk], ...}` (Qwen3-*-FP8).
  ct_channel compressed-tensors float-quantized, strategy channel: `weight_scale` [N, 1] (bf16).
  ct_tensor  ... strategy tensor, static activations: `weight_scale` [1] and `input_scale` [1].
  ct_block   ... strategy block with block_structure [bn, bk]: `weight_scale` per block.
"""
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.kernels.fp8 import E4M3, dequantize_weight, quantize_weight

FORMATS = ("hf_block", "ct_channel", "ct_tensor", "ct_block")
# quantized projections (router gates, embeddings, norms and lm_head stay as they are)
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _quantize(w: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt in ("hf_block", "ct_block"):
        return quantize_weight(w, E4M3, block)
    if fmt == "ct_channel":
        q, s = quantize_weight(w, E4M3)
        return q, s.to(torch.bfloat16).float()  # llm-compressor stores scales in the model dtype
    s = (w.abs().amax().float() / torch.finfo(E4M3).max).reshape(1)
    return (w.float() / s).clamp(-448, 448).to(E4M3), s


def _quant_config(fmt: str, block: tuple[int, int], ignore: list[str]) -> dict:
    if fmt == "hf_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ignore or None}
    strategy = {"ct_channel": "channel", "ct_tensor": "tensor", "ct_block": "block"}[fmt]
    weights = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": strategy, "symmetric": True,
               "type": "float", "group_size": None, "block_structure": list(block) if strategy == "block" else None}
    acts = {"dynamic": fmt != "ct_tensor", "num_bits": 8, "observer": None if fmt != "ct_tensor" else "minmax",
            "strategy": "token" if fmt != "ct_tensor" else "tensor", "symmetric": True, "type": "float"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$", *ignore], "kv_cache_scheme": None}


def write_fp8_checkpoint(src: str, dst: Path, fmt: str, block: tuple[int, int] = (32, 32),
                         ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Rewrite the model folder `src` into `dst` in format `fmt`; modules named in `ignore`
    (checkpoint names, without `.weight`) stay unquantized and are listed in the config. Returns
    every tensor of the checkpoint as the reference sees it (quantized ones dequantized, float32)."""
    if fmt not in FORMATS:
        raise ValueError(fmt)
    shutil.copytree(src, dst)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out, reference = {}, {}
    for name, t in tensors.items():
        module = name[:-len(".weight")]
        if _QUANTIZED.search(name) and module not in ignore:
            q, s = _quantize(t, fmt, block)
            scale_name = "weight_scale_inv" if fmt == "hf_block" else "weight_scale"
            out[name] = q
            stored = s.to(torch.bfloat16) if fmt == "ct_channel" else s
            out[f"{module}.{scale_name}"] = stored.unsqueeze(-1) if fmt == "ct_channel" else stored
            if fmt == "ct_tensor":
                out[f"{module}.input_scale"] = torch.ones(1)
            blk = block if fmt in ("hf_block", "ct_block") else None
            deq_scale = s if fmt != "ct_tensor" else s.expand(t.shape[0])
            reference[name] = dequantize_weight(q, deq_scale.float(), blk)
        else:
            out[name] = t
            reference[name] = t.float()
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = _quant_config(fmt, block, list(ignore))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return reference

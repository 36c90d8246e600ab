"""Which FP8 scheme a model runs: read from config.json's `quantization_config` (checkpoints
published in FP8) or asked for with `--quantization fp8` (a bf16 checkpoint quantized at load).

Supported on disk:
- Hugging Face fine-grained FP8 (`quant_method: fp8`, `weight_block_size: [bn, bk]`, tensors
  `*.weight` in e4m3 and `*.weight_scale_inv` [ceil(N/bn), ceil(K/bk)]; Qwen3-*-FP8,
  DeepSeek-V3); without `weight_block_size`, one `*.weight_scale` per tensor (AutoFP8).
- compressed-tensors `float-quantized` (llm-compressor): `config_groups.*.weights` with
  `type: float`, `num_bits: 8`, `strategy` tensor | channel | block (`block_structure`),
  tensors `*.weight_scale` ([1], [N, 1] or the block grid).
Activations are always quantized dynamically (per token, or per token and bk columns with block
weights); a checkpoint's static `*.input_scale` is not used.
"""
import re
from dataclasses import dataclass

import torch

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class Fp8Scheme:
    """block: (bn, bk) for block-scaled weights, None for one scale per output row (per-tensor
    checkpoint scales are expanded to rows). scale_name: the checkpoint's scale tensor suffix
    ('' when quantized at load). ignore: module names or `re:` patterns that stay unquantized."""

    block: tuple[int, int] | None
    scale_name: str
    ignore: tuple[str, ...] = ()
    online: bool = False

    def ignores(self, checkpoint_name: str) -> bool:
        """Whether the checkpoint module `checkpoint_name` (e.g. model.layers.0.self_attn.q_proj)
        stays unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], checkpoint_name):
                    return True
            elif f".{entry}." in f".{checkpoint_name}.":  # the name, or a run of its components
                return True
        return False


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config_groups; one FP8 group is supported")
    w = groups[0].get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors: weights {w.get('type')}/{w.get('num_bits')} bits are not "
                         f"supported; only float 8-bit (FP8) is")
    strategy = w.get("strategy")
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if len(block) != 2:
            raise ValueError(f"compressed-tensors: block strategy needs block_structure [bn, bk], got {block}")
    elif strategy in ("channel", "tensor"):
        block = None
    else:
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported "
                         f"(tensor, channel, block are)")
    return Fp8Scheme(block, "weight_scale", tuple(qc.get("ignore") or ()))


def fp8_scheme(hf_config, quantization: str | None) -> Fp8Scheme | None:
    """The scheme for this model: the checkpoint's when it is quantized, else `--quantization`'s."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc:
        return Fp8Scheme(None, "", online=True) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        if block:
            return Fp8Scheme(tuple(block), "weight_scale_inv", ignore)
        return Fp8Scheme(None, "weight_scale", ignore)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"checkpoint quantization {method!r} is not supported (fp8 and compressed-tensors FP8 are)")


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype -> the KV cache's torch dtype (fp8: e4m3, e4m3fnuz on MI300)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        from tandem.kernels.fp8 import fp8_dtype, has_fp8_compute

        if device.type == "cuda" and not has_fp8_compute(device):
            raise ValueError("--kv-cache-dtype fp8 needs a GPU with FP8 (NVIDIA compute capability >= 8.9, "
                             "MI300 or newer); use --kv-cache-dtype auto")
        return fp8_dtype(device.type)
    raise ValueError(f"unknown --kv-cache-dtype {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")

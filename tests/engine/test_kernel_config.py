"""KernelConfig: built from the engine's flags in one place and handed to every layer.

Reference: the flags' dataclass (engine/config.py, kernels/config.py); the layers' own config
objects; a CPU engine's greedy tokens with the default configuration (on the CPU every kernel
path is the torch reference, so a configuration may change nothing there)."""
import argparse
import dataclasses

from tandem.engine import LLM, SamplingParams
from tandem.engine.config import EngineConfig, add_engine_args, config_from_args
from tandem.kernels import KernelConfig


def test_flags_build_the_kernel_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(["--no-pdl", "--no-fuse-norms"]))
    assert config.kernel == KernelConfig(pdl=False, fuse_norms=False)
    assert EngineConfig().kernel == KernelConfig()
    for f in dataclasses.fields(KernelConfig):
        assert f.metadata["help"], f.name
        assert "--" + f.name.replace("_", "-") in parser.format_help()


def test_every_layer_holds_the_engine_kernel_config(tiny_models):
    kernels = KernelConfig(pdl=False, skinny_gemm=False, fuse_norms=False, fuse_rope=False)
    for arch in ("llama", "qwen3_moe"):
        llm = LLM(tiny_models[arch][0], device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                  **dataclasses.asdict(kernels))
        model = llm.engine.runner.model
        holders = [m for m in model.modules() if hasattr(m, "kernels")]
        assert len(holders) > 10 and all(m.kernels is llm.engine.config.kernel for m in holders)
        assert llm.engine.config.kernel == kernels
        default = LLM(tiny_models[arch][0], device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = [[3, 17, 29], [5]]
        assert ([o.token_ids for o in llm.generate(prompts, params)]
                == [o.token_ids for o in default.generate(prompts, params)]), arch
        del llm, default

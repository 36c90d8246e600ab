"""Tandem's engine: requests, scheduler, paged KV cache, model runner, models.

`LLM` is imported lazily so that light users (the API process reading engine.config and
engine.protocol) do not pay for loading torch and transformers.
"""
from tandem.engine.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "GenerationOutput"):
        from tandem.engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

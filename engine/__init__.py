"""Tandem's engine: requests, scheduler, paged KV cache, model runner, models.

`LLM` is imported lazily so that light users (the API process reading engine.config and
engine.protocol) do not pay for loading torch and transformers.
"""
import importlib.abc
import importlib.machinery
import os
import sys

from tandem.engine.sampling_params import SamplingParams


def _checkout_root(path: str) -> bool:
    """Whether a sys.path entry is a Tandem checkout's root (this one's or another's: tandem installed from one,
    run from the other), whose kernels/ folder is tandem.kernels."""
    root = os.path.realpath(path or os.curdir)  # (through links: scripts/device/setup.sh links the parts)
    return os.path.isfile(os.path.join(root, "kernels", "config.py")) and os.path.isfile(
        os.path.join(root, "engine", "llm.py"))


class _HubKernelsFinder(importlib.abc.MetaPathFinder):
    """Run from a source checkout's root (python -m pytest, python -m benchmarks.X, `python -m tandem.server`
    there), the root is on sys.path and its kernels/ folder (tandem.kernels) shadows Hugging Face's `kernels`
    package, which transformers imports by that name where it is installed (5.25 and up require it), failing on
    our folder. This finder, first on sys.meta_path, finds top-level `kernels` on sys.path without checkout roots
    (only when it is imported: a router loads no torch); where that finds nothing, the usual finders go on."""

    def find_spec(self, name, path=None, target=None):
        if name != "kernels":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if not _checkout_root(p)])


if not any(isinstance(f, _HubKernelsFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _HubKernelsFinder())

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "GenerationOutput"):
        from tandem.engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

"""Tandem's `server` command: the OpenAI-compatible API process and the process tree behind it."""
from importlib.metadata import PackageNotFoundError, version

import tandem.engine  # noqa: F401 (first: Hugging Face's kernels package ahead of a checkout root's kernels/ folder)

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.1.0"

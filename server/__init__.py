"""Tandem's `server` command: the OpenAI-compatible API process and the process tree behind it."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.1.0"

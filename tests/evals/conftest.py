"""Eval tests run offline: lm-eval, datasets and transformers read only local folders."""
import os

# datasets reads these when first imported, so they are set before any test module imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import tandem.engine  # noqa: F401 (first: Hugging Face's kernels package ahead of the root's kernels/ folder)
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--eval-device", choices=("cpu", "cuda"), default="cpu",
                     help="where the accuracy evals (-m eval) serve the model: cpu (float32) or cuda (bfloat16)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    from tests import interpreter  # its runs start together (tests/interpreter.py)

    interpreter.collected.update(item.module.__name__ for item in session.items if item.module is not None)

"""Test setup: without a GPU, run Triton kernels under the interpreter (set before kernels import)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device():
    """The device GPU tests run on; CPU tests do not use it."""
    return torch.device("cuda")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))
        elif "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def without_triton_interpreter(monkeypatch):
    """TRITON_INTERPRET unset, as outside the tests on a CPU-only machine, where the Triton
    backend cannot run. The backend is imported first, under the interpreter: Triton and the
    kernels read the flag once, at import, and later tests still use the interpreter."""
    import nvfp4_recipe.backends.triton  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

"""Test setup: without a GPU, run Triton kernels under the interpreter (set before kernels import).

Where the tests run the Triton kernels (docs/testing.md): on a machine without a CUDA GPU, in the
Triton interpreter on CPU tensors; on a GPU machine, compiled on the GPU. The ``kernel_device``
fixture is that device (``nvfp4_cases.KERNEL_DEVICE``); the tests that compare the kernels
(directly, through the triton backend, or in layers with backend="triton") with the reference put
their inputs and modules on it. Tests that need the interpreter are marked
``nvfp4_cases.interpreter_only`` and skipped on a GPU machine. ``cuda`` tests take the ``device``
fixture and need a GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from nvfp4_cases import KERNEL_DEVICE  # noqa: E402  (after TRITON_INTERPRET)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (``python -m pytest -q``, no paths given) runs on one pytest-xdist worker
    per core: on a GPU machine its time is Triton and Inductor compiling kernels, on a CPU the
    Triton interpreter, which one process runs on one core. ``-n 0`` runs it in one process; a
    run of chosen paths, or with ``--pdb``, stays in one unless ``-n`` says otherwise. The workers
    compile in their own process (one Inductor compile thread each) instead of each starting a
    pool of its own."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if (whole_suite and config.pluginmanager.hasplugin("xdist")
            and config.option.numprocesses is None and not config.option.usepdb
            and not hasattr(config, "workerinput")):
        config.option.numprocesses = "auto"
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def device():
    """The device GPU tests run on; CPU tests do not use it."""
    return torch.device("cuda")


@pytest.fixture
def kernel_device():
    """Where the Triton kernels run: the CPU under the interpreter, the GPU on a GPU machine."""
    return KERNEL_DEVICE


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
    kernels read the flag once, at import, and later tests still use the interpreter. (On a GPU
    machine the flag is not set: CPU tensors cannot run the Triton backend there either.)"""
    import nvfp4_recipe.backends.triton  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

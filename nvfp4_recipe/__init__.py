"""nvfp4-recipe: NVFP4 training for PyTorch on any device (CPU reference, Triton emulation, Blackwell).

Public API: :class:`NVFP4Recipe` (what to quantize and how), :func:`quantize_` (swap nn.Linear
layers for :class:`NVFP4Linear`, transformers' ``Conv1D`` for :class:`NVFP4Conv1D`, and
mixture-of-experts modules for :class:`NVFP4GroupedExperts` and :class:`NVFP4HFExperts`),
:class:`NVFP4Tensor` (the quantized tensor subclass), and the inspection helpers :func:`summary`,
:func:`tensor_stats` and :func:`capture`, and :func:`cached_weights` (quantize each weight once
for evaluation and generation); checkpoints in and out: :func:`export` (NVFP4 serving checkpoints,
with :func:`record_amaxes`) and :func:`load_frozen` (a frozen :class:`NVFP4FrozenLinear` base for
:func:`lora_config`'s adapters). The typed pieces below them: :class:`QuantSpec` and
:class:`GemmRole` (``spec``), :class:`NVFP4Operand` (``operand``), the backends (``backends``)
and the Triton kernels (``kernels``).
"""

import importlib
import importlib.util

# Public name -> the submodule defining it. The names are imported on first use (PEP 562), so that
# `import nvfp4_recipe` (and the command's --help) does not import torch.
_PUBLIC = {"NVFP4Recipe": "recipe", "NVFP4Tensor": "tensor", "NVFP4Linear": "linear",
           "NVFP4Conv1D": "conv1d", "NVFP4GroupedExperts": "moe", "NVFP4HFExperts": "moe",
           "NVFP4Operand": "operand", "QuantSpec": "spec", "GemmRole": "spec", "quantize_": "api",
           "dequantize_": "api", "set_recipe": "api", "summary": "inspect", "tensor_stats": "inspect", "capture": "inspect",
           "QuantStats": "inspect",
           "cached_weights": "layer", "export": "serving", "record_amaxes": "serving",
           "NVFP4FrozenLinear": "frozen", "load_frozen": "frozen", "lora_config": "frozen",
           "enable_fp4_all_gather": "fsdp", "all_gather_bytes": "fsdp"}

__all__ = list(_PUBLIC)


def _import_public() -> None:
    """Import every public name at once, as the package's import used to: importing ``api``
    registers NVFP4Recipe with torchao's quantize_, which uses no name of ``api``."""
    for name, module in _PUBLIC.items():
        globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)


def __getattr__(name: str):
    """A public name (all of them are imported at its first use) or a submodule."""
    if name in _PUBLIC:
        _import_public()
        return globals()[name]
    if importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

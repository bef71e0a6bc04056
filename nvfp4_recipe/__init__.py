"""nvfp4-recipe: NVFP4 training for PyTorch on any device (CPU reference, Triton emulation, Blackwell).

Public API: :class:`NVFP4Recipe` (what to quantize and how), :func:`quantize_` (swap nn.Linear
layers for :class:`NVFP4Linear`, transformers' ``Conv1D`` for :class:`NVFP4Conv1D`, and
mixture-of-experts modules for :class:`NVFP4GroupedExperts` and :class:`NVFP4HFExperts`),
:class:`NVFP4Tensor` (the quantized tensor subclass), and the inspection helpers :func:`summary`,
:func:`tensor_stats` and :func:`capture`, and :func:`cached_weights` (quantize each weight once
for evaluation and generation). The typed pieces below them: :class:`QuantSpec` and
:class:`GemmRole` (``spec``), :class:`NVFP4Operand` (``operand``), the backends (``backends``)
and the Triton kernels (``kernels``).
"""

import logging
import os


class _DropRecord(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _import_torchao_quietly() -> None:
    """Import torchao without its import-time log lines (a library import prints nothing).

    We use torchao's Python layers only (AOBaseConfig, TorchAOBaseTensor, the quantize_ handler
    registry); its compiled extensions are built for other torch versions, so we skip loading them
    (TORCHAO_FORCE_SKIP_LOADING_SO_FILES, set for this import only unless the user set it). torchao
    then logs that it skipped them, and registering its enums with torch's pytree logs a torch
    deprecation warning; those two records are dropped, during this import only.
    """
    env = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"
    drops = {"torchao": _DropRecord("Skipping import of cpp extensions due to " + env),
             "torch.utils._pytree": _DropRecord("is an Enum subclass and is now natively supported")}
    set_env = env not in os.environ
    if set_env:
        os.environ[env] = "1"
    for name, drop in drops.items():
        logging.getLogger(name).addFilter(drop)
    try:
        import torchao  # noqa: F401
    finally:
        for name, drop in drops.items():
            logging.getLogger(name).removeFilter(drop)
        if set_env:
            del os.environ[env]


_import_torchao_quietly()

from .api import dequantize_, quantize_  # noqa: E402
from .conv1d import NVFP4Conv1D  # noqa: E402
from .inspect import capture, summary, tensor_stats  # noqa: E402
from .layer import cached_weights  # noqa: E402
from .linear import NVFP4Linear  # noqa: E402
from .moe import NVFP4GroupedExperts, NVFP4HFExperts  # noqa: E402
from .operand import NVFP4Operand  # noqa: E402
from .recipe import NVFP4Recipe  # noqa: E402
from .spec import GemmRole, QuantSpec  # noqa: E402
from .tensor import NVFP4Tensor  # noqa: E402

__all__ = ["NVFP4Recipe", "NVFP4Tensor", "NVFP4Linear", "NVFP4Conv1D", "NVFP4GroupedExperts",
           "NVFP4HFExperts", "NVFP4Operand", "QuantSpec", "GemmRole", "quantize_", "dequantize_",
           "summary", "tensor_stats", "capture", "cached_weights"]

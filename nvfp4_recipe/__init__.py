"""nvfp4-recipe: NVFP4 training for PyTorch on any device (CPU reference, Triton emulation, Blackwell).

Public API: :class:`NVFP4Recipe` (what to quantize and how), :func:`quantize_` (swap nn.Linear
layers for :class:`NVFP4Linear`), :class:`NVFP4Tensor` (the quantized tensor subclass), and the
inspection helpers :func:`summary` and :func:`tensor_stats`.
"""

import os

# We use torchao's Python layers only (AOBaseConfig, TorchAOBaseTensor, quantize_); its compiled
# extensions are built for other torch versions and print load failures on import.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from .api import dequantize_, quantize_  # noqa: E402
from .inspect import summary, tensor_stats  # noqa: E402
from .linear import NVFP4Linear  # noqa: E402
from .recipe import NVFP4Recipe  # noqa: E402
from .tensor import NVFP4Tensor  # noqa: E402

__all__ = ["NVFP4Recipe", "NVFP4Tensor", "NVFP4Linear", "quantize_", "dequantize_", "summary",
           "tensor_stats"]

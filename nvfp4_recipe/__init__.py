"""nvfp4-recipe: NVFP4 training for PyTorch on any device (CPU reference, Triton emulation, Blackwell).

Public API: :class:`NVFP4Recipe` (what to quantize and how), :func:`quantize_` (swap nn.Linear
layers for :class:`NVFP4Linear`), :class:`NVFP4Tensor` (the quantized tensor subclass), and the
inspection helpers :func:`summary` and :func:`tensor_stats`.
"""

from .api import dequantize_, quantize_
from .inspect import summary, tensor_stats
from .linear import NVFP4Linear
from .recipe import NVFP4Recipe
from .tensor import NVFP4Tensor

__all__ = ["NVFP4Recipe", "NVFP4Tensor", "NVFP4Linear", "quantize_", "dequantize_", "summary",
           "tensor_stats"]

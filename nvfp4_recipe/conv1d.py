"""NVFP4Conv1D: transformers' ``Conv1D`` (the projections of GPT-2 and the other OpenAI-GPT-style
models: ``y = x @ W + b`` with W of shape (in, out)) trained in NVFP4.

It is an :class:`NVFP4Linear` whose forward runs the layer algorithm on ``W^T``, a view of the
(in, out) Parameter, which keeps its shape and name, so checkpoints (``save_pretrained``,
``load_state_dict``) are those of the Conv1D. With 2D (16x16) weight blocks, W and W^T quantize to
the same values, transposed; with 1D blocks, W^T is quantized along ``in``, the GEMM's reduction
dimension, as NVFP4Linear quantizes its weight.

transformers is not imported: a Conv1D is recognized by its class name and attributes
(:func:`is_conv1d`).
"""

from typing import Tuple

import torch
from torch import nn

from .layer import NVFP4Module
from .linear import NVFP4Linear

__all__ = ["NVFP4Conv1D", "is_conv1d", "features"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers-style ``Conv1D``: class name ``Conv1D``, ints ``nx``
    (in) and ``nf`` (out), and a ``weight`` Parameter of shape (nx, nf)."""
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, nn.Parameter)
            and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def features(module: nn.Module) -> Tuple[int, int]:
    """(in, out) features of an nn.Linear or a Conv1D."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features,
                                                              module.out_features)


class NVFP4Conv1D(NVFP4Linear):
    """A transformers ``Conv1D`` trained with all three GEMMs in NVFP4 (see the module docstring),
    made by ``NVFP4Conv1D.from_module(conv1d, recipe, layer_seed)`` (``quantize_`` does).

    Input (..., in) -> output (..., out), as the Conv1D; ``weight`` (in, out) and ``bias`` (out,)
    are the Conv1D's Parameters (an optimizer built before the swap still updates them), and
    ``nx``, ``nf``, ``in_features``, ``out_features`` its sizes. Buffers, training and inference:
    as :class:`NVFP4Linear`. Not tensor parallel. :meth:`dequantize` gives the Conv1D back.

    Raises:
        ValueError: in or out not a positive multiple of 16 (at conversion); as NVFP4Linear in
            forward.
    """

    KEEPS_ORIGINAL = True  # a Conv1D: transformers is not imported to build one
    dequantize = NVFP4Module.dequantize  # the Conv1D it was made from, holding the Parameters

    def __init__(self, *args, **kwargs):
        raise TypeError("an NVFP4Conv1D is made from a transformers Conv1D: "
                        "NVFP4Conv1D.from_module(conv1d, recipe, layer_seed)")

    def _adopt(self, conv1d: nn.Module) -> None:
        """``conv1d``'s sizes and its weight (in, out) and bias Parameters (:meth:`from_module`)."""
        self.nx, self.nf = conv1d.weight.shape
        self._hold(self.nx, self.nf, conv1d.weight, conv1d.bias)

    def reset_parameters(self) -> None:
        """transformers' Conv1D initialization (weight normal with std 0.02, bias zeros), and
        :meth:`reset_recipe_buffers`."""
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.reset_recipe_buffers()

    def fprop_weight(self) -> torch.Tensor:
        """W (out, in): the transposed view of the (in, out) Conv1D weight."""
        return self.weight.t()

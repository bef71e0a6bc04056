"""NVFP4Linear: an nn.Linear whose three GEMMs (fprop, dgrad, wgrad) run in NVFP4.

The layer runs the algorithm of ``gemms.py`` (the recipe table of docs/recipe.md) in its dense
layout (:class:`gemms.Dense`). The weight stays a high-precision master parameter; it is quantized
on every forward (once per weight version inside :func:`cached_weights`, for evaluation and
generation). Backward keeps the quantized columnwise X^T (and W^T), not the high-precision X. A
tensor-parallel layer (DTensor weight) runs the same algorithm on its shards
(``tensor_parallel.py``).
"""

from typing import Callable, Optional

import torch
from torch import nn

from . import gemms, quantizers
from .backends import get_backend
from .formats import BLOCK
from .forward import Cache, forward_gemms
from .layer import (DenseRecorder, NVFP4Module, autocast_off, backend_name, check_sizes, local,
                    out_dtype)
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe
from .tensor import NVFP4Tensor
from .tensor_parallel import TensorParallelShard, is_tensor_parallel, tensor_parallel_forward


__all__ = ["NVFP4Linear"]


_DENSE = gemms.Dense()


def _dense(shard: Optional[TensorParallelShard]) -> gemms.Dense:
    """The dense layout of a layer, or of its tensor-parallel ``shard``."""
    return _DENSE if shard is None else gemms.Dense(shard)


def _check_tokens(x2: torch.Tensor, weight: torch.Tensor, recipe: NVFP4Recipe) -> None:
    """In training (grad mode on and the weight requiring grad), wgrad's blocks of 16 run along
    the tokens.

    Raises:
        ValueError: a weight gradient to compute in NVFP4 from a token count not a multiple of
            16, with how to pad.
    """
    if (torch.is_grad_enabled() and weight.requires_grad and recipe.backward_override is None
            and x2.shape[0] % BLOCK):
        raise ValueError(
            f"NVFP4 wgrad quantizes along tokens in blocks of {BLOCK}: in training the number "
            f"of tokens (product of the input's leading dims) must be a multiple of {BLOCK}, "
            f"got {x2.shape[0]}. Pad each batch to a multiple of {BLOCK} tokens (Hugging Face: "
            f"DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of={BLOCK}))"
            f" or pack sequences; inference under torch.no_grad takes any number")


def _check_dtypes(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """nn.Linear's rule: outside autocast, the input and the bias have the weight's dtype.

    Raises:
        RuntimeError: with nn.Linear's wording and the dtypes.
    """
    if torch.is_autocast_enabled(x.device.type):
        return
    for what, t in (("mat1 and mat2", x), ("the bias and the weight", bias)):
        if t is not None and t.dtype != weight.dtype:
            raise RuntimeError(f"{what} must have the same dtype, but got {t.dtype} and "
                               f"{weight.dtype} (NVFP4Linear follows nn.Linear: outside autocast the "
                               f"input and the bias take the weight's dtype)")


class NVFP4Linear(NVFP4Module, nn.Linear):
    """nn.Linear trained with all three GEMMs in NVFP4 under an :class:`NVFP4Recipe`.

    Shapes as nn.Linear: input (..., in_features) -> output (..., out_features); in_features and
    out_features must be positive multiples of 16. Parameters are the usual high-precision
    ``weight`` and ``bias``.

    Training (grad mode on and the input, weight or bias requiring grad) runs fprop and saves the
    quantized W^T and X^T for dgrad and wgrad; the number of tokens (the product of the input's
    leading dims) must then be a multiple of 16, since wgrad blocks run along tokens. Otherwise
    (``torch.no_grad``, ``torch.inference_mode``, frozen weights and input) the layer runs fprop
    only: any number of tokens, no X^T or W^T quantized, nothing saved. An input with no elements
    gives nn.Linear's empty result (and zero weight gradient).

    Buffers (saved in the state dict next to nn.Linear's keys), all set from ``recipe`` and
    ``layer_seed``, which the layer keeps (:meth:`reset_recipe_buffers`):
        rht_signs: (16,) float32 +-1 signs of the RHT on the wgrad operands.
        sr_seed: int64 scalar, this layer's Philox key (low 32 bits): ``(recipe.seed +
            layer_seed) mod 2**32``.
        sr_step: int64 scalar, advanced by every backward; a backward's SR stream is keyed by
            ``sr_seed + sr_rank + (sr_step << 32)`` (:func:`layer.sr_key`) with the value before the
            advance.
    ``reset_parameters()`` resets them too, and moving the layer off the meta device
    (``to_empty``) sets them, so a model built on the meta device and materialized gets the same
    buffers as one built on a real device; a loaded state dict overrides them.

    ``weight_group`` (an attribute, None by default): the ``fused.WeightGroup`` of the fused
    projections (q/k/v, gate/up) this layer belongs to, which ``quantize_`` attaches; while
    ``recipe.shared_weight_amax`` is on, W is quantized with the group's shared amax
    (:meth:`shared_weight_amax`).

    ``sr_rank`` (an int attribute, not a buffer, 0 by default): this process's rank among the
    data-parallel ranks, set by ``distributed.set_sr_rank`` so that ranks draw independent SR
    streams. It is neither saved nor broadcast (DDP broadcasts buffers).

    A weight that is a DTensor sharded over a 1-D mesh (``parallelize_module`` with
    ``ColwiseParallel`` / ``RowwiseParallel``) makes the layer tensor parallel:
    ``tensor_parallel.tensor_parallel_forward``.

    ``NVFP4Linear.from_module(linear, recipe, layer_seed)`` makes one from an nn.Linear, sharing
    its weight and bias Parameters (an optimizer built before keeps them); :meth:`dequantize`
    gives a plain nn.Linear holding them back.

    Raises:
        ValueError: a feature count not a positive multiple of 16; a token count not a multiple of
            16 in training; a backend that cannot run on the weight's device.
    """

    weight_group = None  # a fused.WeightGroup, set by quantize_
    KEEPS_ORIGINAL = False  # dequantize() builds a new nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, recipe: Optional[NVFP4Recipe] = None, layer_seed: int = 0):
        check_sizes(type(self).__name__, {"in_features": in_features, "out_features": out_features})
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_nvfp4(recipe, layer_seed, device)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization of ``weight`` and ``bias``, and :meth:`reset_recipe_buffers`."""
        super().reset_parameters()
        if "sr_step" in self._buffers:  # nn.Linear.__init__ calls this before the buffers exist
            self.reset_recipe_buffers()

    def _adopt(self, linear: nn.Linear) -> None:
        """``linear``'s features and its weight and bias Parameters (:meth:`from_module`)."""
        self._hold(linear.in_features, linear.out_features, linear.weight, linear.bias)

    def _hold(self, in_features: int, out_features: int, weight: nn.Parameter,
              bias: Optional[nn.Parameter]) -> None:
        """Take these features and Parameters, as ``nn.Linear.__init__`` sets its own."""
        check_sizes(type(self).__name__, {"in_features": in_features, "out_features": out_features})
        self.in_features, self.out_features = in_features, out_features
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)

    def dequantize(self) -> nn.Module:
        """A plain nn.Linear holding this layer's weight and bias Parameters, in its train mode."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tensor_parallel(self.weight):
            return tensor_parallel_forward(self, x)
        return self.local_forward(x, self.fprop_weight(), self.bias)

    def shared_weight_amax(self) -> Optional[torch.Tensor]:
        """The amax fprop quantizes W with in place of its own: the fused group's
        (``weight_group.amax()``, fp32 0-d) while ``recipe.shared_weight_amax`` is on, else None."""
        if self.weight_group is None or not self.recipe.shared_weight_amax:
            return None
        return self.weight_group.amax()

    def fprop_weight(self) -> torch.Tensor:
        """W (out_features, in_features) as fprop's B operand takes it: the ``weight`` Parameter
        here; a layer that stores W^T (``conv1d.NVFP4Conv1D``) returns a transposed view."""
        return self.weight

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      shard: Optional[TensorParallelShard] = None) -> torch.Tensor:
        """The layer's forward on (local) tensors: x (..., K) -> (..., N) for weight (N, K) and
        bias (N,) or None, this layer's parameters or, with ``shard``, their tensor-parallel
        shards (amaxes reduced over the group). Raises RuntimeError, as nn.Linear, for an input or
        a bias whose dtype is not the weight's outside autocast."""
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"NVFP4Linear expects input (..., {k}), got {tuple(x.shape)}")
        _check_dtypes(x, weight, bias)
        backend = backend_name(self.recipe.backend.value, weight.device)
        y_dtype = out_dtype(x)
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:  # no tokens: no amax to take; nn.Linear's empty result
            with autocast_off(x.device.type):
                y = nn.functional.linear(x2.to(weight.dtype), weight, bias).to(y_dtype)
        else:
            _check_tokens(x2, weight, self.recipe)
            y = forward_gemms(_dense(shard), x2, weight, bias, self.recipe, local(self.rht_signs),
                              self.sr_state(), backend, y_dtype,
                              cache=None if shard is not None else self._cached_weight(backend),
                              weight_amax=self.shared_weight_amax)
            if self.captured is not None and shard is None:
                self._capture(0, x2, weight, y, DenseRecorder(backend, self.captured.keep),
                              self.shared_weight_amax())
        # _unsafe_view: the (..., N) result is not a view of the (M, N) GEMM output, as with
        # nn.Linear (aten::matmul), so in-place ops and FSDP2 (which warns on views) take it
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], n))

    def _cached_weight(self, backend: str) -> Cache:
        """``forward_gemms``' cache of fprop's W (``cached_operand``, inside
        :func:`cached_weights`): keyed by the Parameter, whose version counter a transposed view
        shares, and by the versions of the fused group's weights, whose amax ``make`` reads."""
        def cached(make: Callable[[], NVFP4Operand]) -> Optional[NVFP4Operand]:
            group = () if self.weight_group is None else self.weight_group.versions()
            return self.cached_operand("weight", self.weight, backend, make, depends=group)
        return cached

    def quantized_weight(self) -> NVFP4Tensor:
        """The weight as fprop quantizes it (the recipe's W spec, the fused group's amax where
        :meth:`shared_weight_amax` gives one, the layer's backend), as an :class:`NVFP4Tensor`
        of shape (out_features, in_features): for inspection and export; training quantizes the
        master weight again on every forward."""
        backend = backend_name(self.recipe.backend.value, self.weight.device)
        with torch.no_grad():
            q = quantizers.build(self.recipe, self.rht_signs, quantizers.FPROP_ONLY,
                                 weight_amax=self.shared_weight_amax()).w.rowwise
            op = get_backend(backend, self.weight.device).quantize(
                self.fprop_weight(), q.spec, amax_reduce=quantizers.amax_reducer(q))
        return NVFP4Tensor.from_operand(op, self.weight.dtype, backend=backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.recipe_repr()}"


"""The weights of a frozen NVFP4 base: a checkpoint's codes, E4M3 block scales and global scale as
the operands of fprop and dgrad, and the base class of the modules that hold them
(``frozen.NVFP4FrozenLinear``, ``frozen_experts.NVFP4FrozenExperts``).

A checkpoint holds 1x16 block scales (compressed-tensors, ModelOpt). A weight trained with 16x16
blocks (the recipe's 2d weights, docs/recipe.md) has one scale on the 16 rows of each tile: read
back as tile scales (:func:`tile_scales`), its W^T is the exact transpose, dgrad's operand in
training. A 1x16-scaled weight has no exact transpose: its W^T is W dequantized (exact) and
quantized again along N (``gemms.Dense.given_columns``), a second rounding that training's W^T
(quantized from the high-precision weight) does not have.

Every function takes one weight (N, K) or the stacked weights of G experts (G, N, K), whose outer
scales are (G,), as the grouped primitives take them (``backends.Backend.quantize_experts``).
"""

import dataclasses
from typing import Optional, Tuple

import torch

from .formats import BLOCK
from .layer import NVFP4Module, check_sizes
from .operand import NVFP4Operand
from .quantizers import Usage
from .recipe import NVFP4Recipe
from .spec import Block, Override, QuantSpec

__all__ = ["GEMMS", "tile_scales", "weight_operand", "check_weight", "FrozenModule"]

GEMMS = ("nvfp4", "bf16")
# the specs of a checkpoint's weight: 1x16 scales (W^T then requantized along N, as 1d), or
# 16x16 tile scales (W^T the exact transpose)
_W_1D, _W_2D = QuantSpec(Block.D1), QuantSpec(Block.D2)


def tile_scales(scale: torch.Tensor) -> Optional[torch.Tensor]:
    """The 16x16 tile scales (..., N/16, K/16) of 1x16 scales (..., N, K/16) whose 16 rows of each
    tile agree (a 2d-quantized weight written as 1x16; for stacked experts, every expert's), else
    None."""
    n = scale.shape[-2]
    if n % BLOCK:
        return None
    tiles = scale.view(torch.uint8).unflatten(-2, (n // BLOCK, BLOCK))
    if not torch.equal(tiles, tiles[..., :1, :].expand_as(tiles)):
        return None
    return tiles[..., 0, :].contiguous().view(torch.float8_e4m3fn)


def weight_operand(qdata: torch.Tensor, scale: torch.Tensor, outer_scale: torch.Tensor) -> NVFP4Operand:
    """A checkpoint's weight (codes (..., N, K/2), 1x16 scales (..., N, K/16), decode scale () or
    (G,)) as an fprop operand: 2d blocks where the 1x16 scales are tile scales (then W^T is its
    exact transpose), else 1d; its spec ``QuantSpec(block)`` (per tensor, RN)."""
    tiles = tile_scales(scale)
    if tiles is None:
        return NVFP4Operand(qdata, scale, outer_scale, _W_1D)
    return NVFP4Operand(qdata, tiles, outer_scale, _W_2D)


def check_weight(layer: str, qdata: torch.Tensor, scale: torch.Tensor, gemm: str) -> Tuple[int, ...]:
    """The logical shape (..., N, K) of a checkpoint's weight, checked.

    Raises:
        ValueError: an unknown ``gemm``; N or K not a positive multiple of 16; 1x16 scales that
            do not go with the codes (naming ``layer``).
        TypeError: ``qdata`` not uint8 or ``scale`` not float8_e4m3fn.
    """
    if gemm not in GEMMS:
        raise ValueError(f"{layer}: gemm must be one of {GEMMS}, got {gemm!r}")
    if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{layer} takes uint8 codes and float8_e4m3fn scales, got "
                        f"{qdata.dtype} and {scale.dtype}")
    *lead, n, half_k = qdata.shape
    check_sizes(layer, {"out_features": n, "in_features": 2 * half_k})
    if tuple(scale.shape) != (*lead, n, 2 * half_k // BLOCK):
        raise ValueError(f"{layer}: 1x16 scales {tuple(scale.shape)} do not go with codes "
                         f"{tuple(qdata.shape)}: an {(*lead, n, 2 * half_k)} weight has "
                         f"{(*lead, n, 2 * half_k // BLOCK)} scales")
    return (*lead, n, 2 * half_k)


class FrozenModule(NVFP4Module):
    """The base of the frozen NVFP4 modules: their weights are buffers of codes (uint8), E4M3
    block scales and fp32 outer scales (:meth:`frozen_buffers`, which ``Module.to(dtype)`` leaves
    in their dtypes), no high-precision copy; fprop and dgrad run (``RECORDED``), no wgrad."""

    RECORDED = Usage(dgrad=True, wgrad=False)  # its GEMMs, which capture records: fprop and dgrad

    def frozen_buffers(self) -> Tuple[str, ...]:
        """The names of the buffers holding the weights' codes and scales."""
        raise NotImplementedError

    @property
    def recipe(self) -> NVFP4Recipe:
        """The layer's recipe (set at construction and by ``set_recipe``)."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: NVFP4Recipe) -> None:
        self._recipe = recipe
        self._gemm_recipe = recipe if self.gemm == "nvfp4" else dataclasses.replace(
            recipe, forward_override=Override.HIGH_PRECISION,
            backward_override=Override.HIGH_PRECISION)

    def gemm_recipe(self) -> NVFP4Recipe:
        """The recipe the GEMMs run under: the layer's for ``gemm="nvfp4"``; for "bf16" the
        layer's with fprop and dgrad in high precision (``forward_override``,
        ``backward_override``), on the weight dequantized for the call."""
        return self._gemm_recipe

    def check_recipe(self, recipe: NVFP4Recipe) -> None:
        """A frozen base has no high-precision weight: the overrides that need one are refused."""
        if recipe.forward_override or recipe.backward_override:
            raise ValueError(f"{type(self).__name__} keeps no high-precision weight, so it takes no "
                             f"forward_override or backward_override; gemm='bf16' multiplies by the "
                             f"dequantized weight instead")

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating-point buffer: the E4M3 block scales and the fp32
        # outer scale would lose their values. They move with the module, in their own dtypes.
        before = {name: self._buffers[name] for name in self.frozen_buffers()}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self


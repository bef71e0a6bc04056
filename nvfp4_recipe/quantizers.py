"""The operand quantizers of one layer call: how each GEMM operand of a step is quantized, built
once per forward and once per backward from the recipe and the layer's state.

After TransformerEngine's ``NVFP4Quantizer`` (one quantizer object per GEMM role, with its
rowwise / columnwise usage, RHT, SR and amax-reduction group): an :class:`OperandQuantizer` is one
operand of one GEMM (a :class:`spec.GemmRole`), a :class:`TensorQuantizer` the rowwise and
columnwise copies of one tensor, each None when that usage is off::

    tensor   rowwise (blocks along K)          columnwise (of the transpose, blocks along rows)
    X        X_FPROP: fprop's A                X_WGRAD: wgrad's B (RHT), saved for backward
    W        W_FPROP: fprop's B                W_FPROP again: dgrad's W^T (its exact transpose
                                               for 2d blocks), saved for backward
    dY       DY_DGRAD: dgrad's A (SR)          DY_WGRAD: wgrad's A (RHT, SR)

:func:`build` makes them (the only place that reads the recipe, the RHT signs, the SR key and the
tensor-parallel shard for the GEMMs), :func:`build_ms_eden` those of an MS-EDEN backward (X^T and
W^T quantized again from X and W); ``gemms.py`` turns them into the backend primitives'
arguments.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from . import reference as R
from .backends import AmaxReduce, IntOrTensor
from .recipe import MS_EDEN_OFFSETS, ROTATION_SIGNS_OFFSET, SR_OFFSETS, NVFP4Recipe
from .spec import GemmRole, QuantSpec

__all__ = ["OperandQuantizer", "TensorQuantizer", "Quantizers", "Usage", "FPROP_ONLY", "build",
           "build_ms_eden", "amax_reducer", "inspected"]


class OperandQuantizer(NamedTuple):
    """How one GEMM operand is quantized (TE's ``NVFP4Quantizer`` for one usage).

    Fields:
        role: the operand's GemmRole; spec: ``recipe.spec(role)`` (an MS-EDEN backward's W^T,
            role W_FPROP: the spec of DY_DGRAD, the other operand of its GEMM).
        signs: (16,) float32 +-1 RHT signs, only when ``spec.rht``; an MS-EDEN operand's
            rotation signs; else None.
        seed: the Philox key of the SR stream (an int64 device scalar in backward), 0 in forward.
        offset: where the operand's SR counters start: ``recipe.SR_OFFSETS[role]`` plus, for a
            tensor-parallel shard, the blocks of the shards before it
            (``TensorParallelShard.sr_offset``); 0 for the forward operands (round to nearest).
        amax_reduce: :data:`backends.AmaxReduce`: the max over the tensor-parallel group of a
            sharded operand's amax (``TensorParallelShard.amax_reduce``), or None.
        gemm_only: the copy is used by its GEMM only (neither saved for backward nor returned),
            so a backend may hand it back in another form than codes.
        amax: None, or the fp32 0-d per-tensor amax to quantize with instead of the operand's own
            (W only: a fused group's shared weight amax, ``fused.WeightGroup.amax``, already
            reduced over a tensor-parallel group).
    """

    role: GemmRole
    spec: QuantSpec
    signs: Optional[torch.Tensor]
    seed: IntOrTensor
    offset: IntOrTensor
    amax_reduce: AmaxReduce
    gemm_only: bool
    amax: Optional[torch.Tensor] = None


class TensorQuantizer(NamedTuple):
    """The quantizers of one tensor's copies: rowwise (its rows, blocks along K) and columnwise
    (its transpose, blocks along its rows), each None when that usage is off (TE's
    rowwise / columnwise usage)."""

    rowwise: Optional[OperandQuantizer]
    columnwise: Optional[OperandQuantizer]


class Quantizers(NamedTuple):
    """The quantizers of one pass of a layer: X and W in forward (``dy`` None), dY in backward
    (``x`` and ``w`` None). W's rowwise quantizer is always there (a W^T is made from W's
    quantization); X has no rowwise one where the recipe's ``forward_override`` takes fprop out
    of NVFP4. An MS-EDEN backward (:func:`build_ms_eden`) has all three: X and W columnwise."""

    x: Optional[TensorQuantizer]
    w: Optional[TensorQuantizer]
    dy: Optional[TensorQuantizer]


class Usage(NamedTuple):
    """Which copies a layer call needs.

    Fields:
        dgrad: dX is computed: W^T kept in forward, dY rowwise in backward.
        wgrad: dW is computed: X^T kept in forward, dY columnwise in backward.
        keep: fprop's X and W are returned too (a dequantized backward), not only fed to the
            fprop GEMM.
    """

    dgrad: bool
    wgrad: bool
    keep: bool = False


FPROP_ONLY = Usage(False, False)  # no gradient (evaluation, cached weights): fprop's X and W


def _quantizer(recipe: NVFP4Recipe, role: GemmRole, signs: torch.Tensor, shard, seed=0,
               offset=0, gemm_only=False) -> OperandQuantizer:
    """Operand ``role``'s quantizer: its spec from the recipe, the signs where it has the RHT, the
    amax reducer of a tensor-parallel ``shard``."""
    spec = recipe.spec(role)
    return OperandQuantizer(role, spec, signs if spec.rht else None, seed, offset,
                            None if shard is None else shard.amax_reduce(role, spec), gemm_only)


def build(recipe: NVFP4Recipe, signs: torch.Tensor, usage: Usage, shard=None,
          dy: Optional[Tuple[int, int]] = None, sr_key: IntOrTensor = 0,
          weight_amax: Optional[torch.Tensor] = None) -> Quantizers:
    """The quantizers of one forward (``dy`` None: X and W) or one backward (``dy`` given: dY).

    Args:
        recipe: the specs (``recipe.spec(role)``) and ``forward_override``.
        signs: (16,) float32 +-1, the layer's RHT signs (used by the RHT operands only).
        usage: which copies are needed (:class:`Usage`).
        shard: None, or the ``tensor_parallel.TensorParallelShard`` of a tensor-parallel layer's
            local operands: amaxes reduced over its group, dY's SR counters shifted past the other
            shards' blocks.
        dy: in backward, dY's local shape (M, N), which the SR shift of a shard depends on.
        sr_key: in backward, the step's SR key (``layer.next_sr_key``).
        weight_amax: in forward, None or the fp32 0-d amax W is quantized with instead of its
            own (a fused group's, ``NVFP4Linear.shared_weight_amax``; reduced here over a
            tensor-parallel ``shard``'s group).
    Returns:
        :class:`Quantizers`.
    Raises:
        ValueError: a backward (``dy``) under ``recipe.backward_estimator``, whose quantizers
            :func:`build_ms_eden` makes from X and W, not from a saved W^T and X^T.
    """
    if dy is not None:
        if recipe.backward_estimator is not None:
            raise ValueError(f"NVFP4Recipe.backward_estimator={recipe.backward_estimator.value!r} "
                             f"quantizes W^T and X^T again from the forward's X and W; a backward "
                             f"from a saved W^T and X^T does not run it")
        m, n = dy
        rows = cols = None
        if usage.dgrad:
            role = GemmRole.DY_DGRAD
            offset = SR_OFFSETS[role] + (0 if shard is None else shard.sr_offset(role, m, n))
            rows = _quantizer(recipe, role, signs, shard, sr_key, offset, True)
        if usage.wgrad:
            role = GemmRole.DY_WGRAD
            offset = SR_OFFSETS[role] + (0 if shard is None else shard.sr_offset(role, n, m))
            cols = _quantizer(recipe, role, signs, shard, sr_key, offset, True)
        return Quantizers(None, None, TensorQuantizer(rows, cols))
    nvfp4 = recipe.forward_override is None
    gemm_only = not (usage.keep and nvfp4)
    w = _quantizer(recipe, GemmRole.W_FPROP, signs, shard, gemm_only=gemm_only)
    if weight_amax is not None:
        w = w._replace(amax=w.amax_reduce(weight_amax) if w.amax_reduce else weight_amax)
    x = TensorQuantizer(
        _quantizer(recipe, GemmRole.X_FPROP, signs, shard, gemm_only=gemm_only) if nvfp4 else None,
        _quantizer(recipe, GemmRole.X_WGRAD, signs, shard) if usage.wgrad else None)
    return Quantizers(x, TensorQuantizer(w, w._replace(gemm_only=False) if usage.dgrad else None),
                      None)


def build_ms_eden(recipe: NVFP4Recipe, usage: Usage, sr_key: IntOrTensor, device) -> Quantizers:
    """The quantizers of an MS-EDEN backward (``recipe.backward_estimator``; Quartet II, arXiv
    2601.22813): dY's rowwise copy (dgrad's A) with W's columnwise copy (dgrad's B: W^T quantized
    again from W), dY's columnwise copy (wgrad's A) with X's (X^T), each None without its GEMM.
    All under the recipe's MS-EDEN spec and one rotation, whose signs
    (``reference.rotation_signs``) come from the step's SR key at ``ROTATION_SIGNS_OFFSET``, so
    that the rotations of each GEMM's two operands cancel in the product; each copy draws its block
    scales' SR from its own counters (``MS_EDEN_OFFSETS``). W^T comes back as codes (the experts'
    layout restacks them), the others may come as inner values (used by their GEMM only).

    Args:
        recipe: an MS-EDEN recipe; usage: dgrad and wgrad (``keep`` unused).
        sr_key: the step's SR key (``layer.next_sr_key``); device: where the signs go.
    Returns:
        :class:`Quantizers` (x, w: columnwise only; dy: both).
    """
    signs = R.rotation_signs(sr_key, ROTATION_SIGNS_OFFSET, recipe.ms_eden_rotation, device)

    def copy(needed: bool, role: GemmRole, spec_of: GemmRole) -> Optional[OperandQuantizer]:
        return OperandQuantizer(role, recipe.spec(spec_of), signs, sr_key, MS_EDEN_OFFSETS[role],
                                None, role is not GemmRole.W_FPROP) if needed else None
    dgrad, wgrad = usage.dgrad, usage.wgrad
    return Quantizers(
        TensorQuantizer(None, copy(wgrad, GemmRole.X_WGRAD, GemmRole.X_WGRAD)),
        TensorQuantizer(None, copy(dgrad, GemmRole.W_FPROP, GemmRole.DY_DGRAD)),
        TensorQuantizer(copy(dgrad, GemmRole.DY_DGRAD, GemmRole.DY_DGRAD),
                        copy(wgrad, GemmRole.DY_WGRAD, GemmRole.DY_WGRAD)))


def amax_reducer(q: OperandQuantizer) -> AmaxReduce:
    """The ``amax_reduce`` argument of a backend primitive quantizing ``q``'s operand: the given
    amax ``q.amax`` where set (a tensor: the operand's own is not measured), else
    ``q.amax_reduce``."""
    return q.amax_reduce if q.amax is None else q.amax


def inspected(q: TensorQuantizer) -> TensorQuantizer:
    """``q`` for copies recorded to be inspected (``inspect.capture``, ``QuantStats``): none is
    used by its GEMM only, so every backend returns them as codes, with the same bits."""
    return TensorQuantizer(*(c and c._replace(gemm_only=False) for c in q))

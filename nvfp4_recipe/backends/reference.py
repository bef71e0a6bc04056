"""The reference backend: the numerics spec (``nvfp4_recipe.reference``) in plain PyTorch, any device."""

from typing import Optional, Tuple

import torch

from .. import reference as R
from ..operand import NVFP4Operand
from ..spec import Block, QuantSpec
from . import AmaxReduce, Backend, IntOrTensor, quantize_each, reduced_amax, register_backend
from . import grouped


def _reduced_amax(x: torch.Tensor, spec: QuantSpec, signs: Optional[torch.Tensor],
                  amax_reduce: AmaxReduce) -> Optional[torch.Tensor]:
    """The ``amax_`` of ``reference.quantize``: None (its own) without a reducer, else the reduced
    measured amax, times the spec's amax_scale under amax estimation."""
    amax_ = reduced_amax(amax_reduce, lambda: R.operand_amax(x, spec, signs))
    return amax_ if amax_ is None or spec.amax_scale is None else spec.amax_scale * amax_


@register_backend
class ReferenceBackend(Backend):
    """Plain PyTorch: quantization is ``reference.quantize`` (MS-EDEN specs too), the GEMM
    dequantizes both operands to fp32 and multiplies them (``reference.scaled_mm``)."""

    name = "reference"
    runs_ms_eden = True
    fakes = {"quantize_groups": grouped.fake_quantize_groups,
             "grouped_mm": grouped.fake_grouped_mm}

    def quantize(self, x: torch.Tensor, spec: QuantSpec, *, seed: IntOrTensor = 0,
                 offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                 amax_reduce: AmaxReduce = None) -> NVFP4Operand:
        """``reference.quantize``; with ``amax_reduce``, the amax (``reference.operand_amax``)
        is taken first and reduced (an RHT operand's transform then runs twice)."""
        return R.quantize(x, spec, seed=seed, offset=offset, rht_signs=signs,
                          amax_=_reduced_amax(x, spec, signs, amax_reduce))

    def quantize_pair(self, x, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                      transient=(False, False), prepare=None, amax_reduce=(None, None)):
        """Two :meth:`quantize` calls (x and x.t()); ``transient`` changes nothing here and
        ``prepare`` comes back as it is."""
        return (*quantize_each(self, x, row, col, seed, row_offset, col_offset, signs, amax_reduce),
                prepare)

    def prepare_weight(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                       amax_reduce: AmaxReduce = None,
                       ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        amax_ = _reduced_amax(w, spec, None, amax_reduce)
        wq = R.quantize(w, spec, amax_=amax_)
        if not need_t:
            return wq, None
        if spec.block is Block.D2:
            return wq, R.transpose_2d(wq)
        return wq, R.quantize(w.t(), spec, amax_=amax_)

    def prepare(self, b: NVFP4Operand) -> NVFP4Operand:
        return b

    def transpose_2d(self, b: NVFP4Operand) -> NVFP4Operand:
        return R.transpose_2d(b)

    def mm(self, a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return R.scaled_mm(a, b, bias=bias, out_dtype=out_dtype)

    def quantize_groups(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                        transient=(False, False), prepare=None):
        """``grouped.quantize_groups`` (codes; ``transient`` changes nothing, ``prepare`` comes
        back as it is)."""
        return (*grouped.quantize_groups(x, offs, row, col, seed=seed, row_offset=row_offset,
                                         col_offset=col_offset, signs=signs), prepare)

    def quantize_experts(self, w, spec, *, need_t, transient=False):
        """``grouped.quantize_experts`` (codes)."""
        return grouped.quantize_experts(w, spec, need_t=need_t)

    def grouped_mm(self, a, b, *, out_dtype=torch.float32):
        return grouped.grouped_mm(a, b, out_dtype=out_dtype)

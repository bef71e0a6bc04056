"""The reference backend: the numerics spec (``nvfp4_recipe.reference``) in plain PyTorch, any device."""

from typing import Optional, Tuple

import torch

from .. import reference as R
from ..operand import NVFP4Operand
from ..spec import Block, QuantSpec
from . import Backend, IntOrTensor, quantize_each, register_backend


@register_backend
class ReferenceBackend(Backend):
    """Plain PyTorch: quantization is ``reference.quantize``, the GEMM dequantizes both operands to
    fp32 and multiplies them (``reference.scaled_mm``)."""

    name = "reference"

    def quantize(self, x: torch.Tensor, spec: QuantSpec, *, seed: IntOrTensor = 0,
                 offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None) -> NVFP4Operand:
        return R.quantize(x, spec, seed=seed, offset=offset, rht_signs=signs)

    def quantize_pair(self, x, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                      transient=(False, False), prepare=None):
        """Two :meth:`quantize` calls (x and x.t()); ``transient`` changes nothing here and
        ``prepare`` comes back as it is."""
        return (*quantize_each(self, x, row, col, seed, row_offset, col_offset, signs), prepare)

    def prepare_weight(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                       ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        wq = self.quantize(w, spec)
        if not need_t:
            return wq, None
        return wq, R.transpose_2d(wq) if spec.block is Block.D2 else self.quantize(w.t(), spec)

    def prepare(self, b: NVFP4Operand) -> NVFP4Operand:
        return b

    def mm(self, a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return R.scaled_mm(a, b, bias=bias, out_dtype=out_dtype)

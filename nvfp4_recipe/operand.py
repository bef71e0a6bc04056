"""NVFP4Operand: the one quantized-operand type of the package.

A leaf module: the reference, the kernels, the backends, the layer and ``NVFP4Tensor`` all pass
quantized data around as this NamedTuple. Layout (docs/numerics.md): an operand is a
(rows, K) matrix with its blocks of 16 along K, the GEMM reduction dimension, so fprop, dgrad and
wgrad are all ``A @ B^T`` of two such operands and nothing quantized is ever transposed in memory.
"""

from typing import NamedTuple, Optional

import torch

from .spec import Block, Form, QuantSpec


class NVFP4Operand(NamedTuple):
    """Quantized data of one operand (..., rows, K), with the spec it was quantized under and its
    form (codes, or inner values) explicit, so what a GEMM used is inspectable as it is.

    Fields:
        qdata: uint8 (..., rows, K // 2), two E2M1 codes per byte, the even element in the low
            nibble (viewable as ``torch.float4_e2m1fn_x2``); None when only ``values`` were written.
        scale: float8_e4m3fn block decode scales, (..., rows, K // 16) for Block.D1 or
            (rows // 16, K // 16) for Block.D2; None with qdata.
        outer_scale: float32 outer decode scale S_dec = 1 / min(2688 / amax, FLT_MAX): () per
            tensor or (..., rows) per token (a grouped operand's: one per group, see
            :class:`GroupedOperand`).
        spec: the :class:`QuantSpec` the operand was quantized under (its block layout, scaling,
            rounding, RHT, amax scale, 4/6). An operand derived from another (a slice, the exact
            transpose of 2d codes, its inner values, a view with its outer scales spread over the
            rows) keeps its spec. Default ``QuantSpec()`` (1x16 blocks, per tensor, RN), for
            operands built from raw codes.
        values: the inner values (codes x block scales) as float16 (rows, K), exact, when a
            quantize kernel wrote them for a GEMM that uses them at once (no dequantize pass);
            else None.
    """

    qdata: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    outer_scale: torch.Tensor
    spec: QuantSpec = QuantSpec()
    values: Optional[torch.Tensor] = None

    @property
    def block(self) -> Block:
        """The scale layout, ``spec.block``: Block.D1 or Block.D2."""
        return self.spec.block

    @property
    def form(self) -> Form:
        """Form.VALUES when the operand holds fp16 inner values (a GEMM takes them in place of the
        codes), else Form.CODES."""
        return Form.CODES if self.values is None else Form.VALUES

    @property
    def rows(self) -> int:
        return (self.qdata if self.form is Form.CODES else self.values).shape[-2]

    @property
    def k(self) -> int:
        return 2 * self.qdata.shape[-1] if self.form is Form.CODES else self.values.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.outer_scale.device


class GroupedOperand(NamedTuple):
    """Quantized data of an operand split into G groups (one per expert) along its token dimension.

    Groups are contiguous and follow ``torch._grouped_mm``'s convention: ``offs`` holds each
    group's end, group g spans ``[offs[g - 1], offs[g])`` (from 0 for g = 0), so groups may be
    empty. Two layouts, the two ways tokens enter a GEMM (docs/moe.md):

    - ``along_k=False`` (fprop's X, dgrad's dY): ``data`` is the (T, K) matrix of all tokens,
      blocks of 16 along K; group g is a range of rows. ``outer_scale``: (G,) one per group, or
      with ``per_token`` (T,) one per row.
    - ``along_k=True`` (wgrad's X^T and dY^T): ``data`` is the (R, T) matrix x^T, blocks of 16
      along the tokens; group g is a range of columns (of the reduction dimension), each group's
      blocks within it. ``outer_scale``: (G,), or with ``per_token`` (G, R): one per row of each
      group's x_g^T.

    Fields:
        data: an :class:`NVFP4Operand` (1d blocks, carrying the copy's spec) whose
            ``outer_scale`` is laid out as above.
        offs: int32 (G,) cumulative group ends along the token dimension, on the data's device.
        along_k: the layout, see above.
        per_token: whether the outer scales are per row (per token, or per row of x_g^T).
    """

    data: NVFP4Operand
    offs: torch.Tensor
    along_k: bool = False
    per_token: bool = False

    @property
    def groups(self) -> int:
        return self.offs.shape[0]

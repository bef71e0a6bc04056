"""The ``triton`` backend: NVFP4 quantization with the fused Triton kernels of ``kernels/``.

Gives the same bits as the reference backend (``Backend``) for every ``OperandSpec``; the GEMM is
the Triton NVFP4 GEMM of ``kernels/gemm.py``. Runs on CUDA GPUs and, for
tests, under ``TRITON_INTERPRET=1`` on the CPU. Nothing here synchronises with the host: amaxes stay
on the device and SR seeds/offsets may be device tensors.

Layout of the work (kernels/quantize.py): a 1D operand is an amax pass plus one quantize pass that
reads the (M, K) matrix once and writes the rowwise and/or columnwise copies; a 2D operand (weights)
is an amax pass plus one pass writing W and its exact transpose.

In NVFP4Linear (``Backend.linear_fprop`` and ``linear_grads``, through ``gemm_operands``,
``b_operand`` and ``operand_mm``) the copies a GEMM uses at once (X for fprop, dY for dgrad, dY^T
for wgrad) are written as fp16 inner values (codes x block scales) instead of codes, so their GEMMs
skip the dequantize pass of that operand (``gemm.inner_mm``); W and W^T are dequantized to inner
values by ``b_operand`` (in CUDA graphs on the side stream of ``streams``, while X and dY are
quantized), and X^T, wgrad's B, by the dY pass itself (``gemm_operands(b=...)``: its memory
traffic overlaps that pass's arithmetic). The values are exactly those the dequantize pass would
give, so the results are the same bits.
"""

from typing import Optional, Tuple, Union

import torch

from . import reference as R
from .backends import Backend, register_backend, warn_once
from .kernels import gemm as G
from .kernels.quantize import CopySpec, Inner, Quantized, quantize_1d, quantize_2d
from .recipe import OperandSpec
from .reference import NVFP4Data


def _copy_spec(spec: OperandSpec) -> CopySpec:
    return CopySpec(sr=spec.rounding == "sr", rht=spec.rht, per_token=spec.scaling == "per_token",
                    amax_scale=spec.amax_scale)


def _data(q: Quantized) -> NVFP4Data:
    return NVFP4Data(q.qdata, q.scale, q.outer_scale)


def _is_transposed_view(x: torch.Tensor) -> bool:
    """True for a 2-D non-contiguous x whose transpose is contiguous (x = base.t())."""
    return x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous()


def _signs(rht_signs: Optional[torch.Tensor], spec: OperandSpec) -> Optional[torch.Tensor]:
    if not spec.rht:
        return None
    if rht_signs is None:
        raise ValueError("an RHT operand needs rht_signs")
    return rht_signs


@register_backend
class TritonBackend(Backend):
    """Fused Triton quantization kernels (sm80/sm90 GPUs; the interpreter in tests)."""

    name = "triton"

    def quantize(self, x: torch.Tensor, spec: OperandSpec, seed: R.IntOrTensor = 0,
                 offset: R.IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None) -> NVFP4Data:
        """``Backend.quantize`` with the Triton kernels: x (..., M, K) quantized along K.

        A 2-D ``x`` that is the transpose view of a contiguous matrix (``base.t()``) is read through
        the columnwise path of ``base`` (coalesced); other layouts are read as they are.
        Raises: TypeError / ValueError as ``reference.check_input``.
        """
        R.check_input(x, spec.block, spec.scaling, spec.rounding)
        signs = _signs(rht_signs, spec)
        if spec.block == "2d":
            return self._quantize_2d(x, spec, seed, offset, signs)
        copy = _copy_spec(spec)
        if _is_transposed_view(x):
            return _data(quantize_1d(x.t(), col=copy, seed=seed, col_offset=offset, signs=signs)[1])
        lead, (m, k) = x.shape[:-2], x.shape[-2:]
        x2 = x.reshape(-1, k)
        q = quantize_1d(x2, row=copy, seed=seed, row_offset=offset, signs=signs)[0]
        outer = q.outer_scale.reshape(*lead, m) if copy.per_token else q.outer_scale
        return NVFP4Data(q.qdata.reshape(*lead, m, k // 2), q.scale.reshape(*lead, m, k // 16), outer)

    def quantize_pair(self, x: torch.Tensor, row: OperandSpec, col: OperandSpec,
                      seed: R.IntOrTensor = 0, row_offset: R.IntOrTensor = 0,
                      col_offset: R.IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None,
                      ) -> Tuple[NVFP4Data, NVFP4Data]:
        """Rowwise and columnwise copies of a 2-D x (M, K) from one read (one amax pass covering
        both copies, one quantize pass); other cases fall back to two ``quantize`` calls."""
        if not _one_pass(x, row, col):
            return super().quantize_pair(x, row, col, seed, row_offset, col_offset, rht_signs)
        r, c, _ = _quantize_copies(x, row, col, (False, False), seed, row_offset, col_offset,
                                   rht_signs)
        return _data(r), _data(c)

    def quantize_weight(self, w: torch.Tensor, spec: OperandSpec) -> Tuple[NVFP4Data, NVFP4Data]:
        """W (N, K) and W^T (K, N): 2d from one read (W^T the exact transpose), 1d as a pair."""
        if spec.block == "2d" and not spec.rht:
            R.check_input(w, spec.block, spec.scaling, spec.rounding)
            wq, wtq = quantize_2d(w, sr=spec.rounding == "sr", amax_scale=spec.amax_scale)
            return _data(wq), _data(wtq)
        if spec.block == "1d" and not spec.rht:
            return self.quantize_pair(w, spec, spec)
        return super().quantize_weight(w, spec)

    def scaled_mm(self, a: NVFP4Data, b: NVFP4Data, a_block: str = "1d", b_block: str = "1d",
                  bias: Optional[torch.Tensor] = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``Backend.scaled_mm`` with the Triton NVFP4 GEMM (``kernels/gemm.py``)."""
        return G.scaled_mm(*a, *b, a_block=a_block, b_block=b_block, bias=bias, out_dtype=out_dtype)

    def gemm_operands(self, x: torch.Tensor, row: Optional[OperandSpec],
                      col: Optional[OperandSpec], seed: R.IntOrTensor = 0,
                      row_offset: R.IntOrTensor = 0, col_offset: R.IntOrTensor = 0,
                      rht_signs: Optional[torch.Tensor] = None,
                      transient: Tuple[bool, bool] = (True, True), b: Optional[NVFP4Data] = None):
        """``Backend.gemm_operands`` from one quantize pass, the transient copies written as
        :class:`Inner` fp16 values (GPUs with E4M3 conversion, sm89+, and the interpreter), b's
        inner values written by the same launch where it has a columnwise copy."""
        if (row is None and col is None) or not _one_pass(x, row, col) or not \
                G.inner_values_supported(x.device):
            return super().gemm_operands(x, row, col, seed, row_offset, col_offset, rht_signs,
                                         transient, b)
        r, c, b_inner = _quantize_copies(x, row, col, transient, seed, row_offset, col_offset,
                                         rht_signs, b)
        if b is not None and b_inner is None:  # no columnwise copy in that launch to ride on
            b_inner = self.b_operand(b, "1d")
        return _operand(r), _operand(c), b_inner

    def b_operand(self, b: NVFP4Data, block: str):
        """``Backend.b_operand``: B's fp16 inner values (:class:`Inner`, one dequantize pass) where
        the GEMM operands are inner values (:func:`gemm.inner_values_supported`), else b."""
        if not G.inner_values_supported(b.qdata.device):
            return b
        values = G.dequantize_inner(b.qdata, b.scale, block, out_dtype=torch.float16)
        return Inner(values, b.outer_scale)

    def operand_mm(self, a, b, b_block: str, bias: Optional[torch.Tensor],
                   out_dtype: torch.dtype) -> torch.Tensor:
        """``Backend.operand_mm``; an :class:`Inner` A skips its dequantize pass
        (``gemm.inner_mm``, B made :class:`Inner` by :meth:`b_operand` unless it is)."""
        # A is codes only where gemm_operands fell back: no inner values on this device (then B
        # has none either) or a layout quantize_1d does not take in one pass, which no recipe's
        # fprop or dgrad operand has (their rowwise copies have 1d blocks and no RHT).
        if not isinstance(a, Inner):
            return super().operand_mm(a, b, b_block, bias, out_dtype)
        if not isinstance(b, Inner):
            b = self.b_operand(b, b_block)
        return G.inner_mm(a.values, a.outer_scale, b.values, b.outer_scale, bias=bias,
                          out_dtype=out_dtype)

    def _quantize_2d(self, x, spec, seed, offset, signs) -> NVFP4Data:
        if spec.rht:  # RHT along K with 16x16 blocks: no recipe asks for it; the reference does it
            warn_once("triton backend: 2d blocks with RHT run on the reference implementation")
            return super().quantize(x, spec, seed, offset, signs)
        sr = spec.rounding == "sr"
        if _is_transposed_view(x) and not sr:  # quantize_2d(x) is the exact transpose of that of x.t()
            return _data(quantize_2d(x.t(), amax_scale=spec.amax_scale, write_w=False)[1])
        return _data(quantize_2d(x, sr=sr, seed=seed, offset=offset, amax_scale=spec.amax_scale,
                                 write_wt=False)[0])


def _one_pass(x: torch.Tensor, row: Optional[OperandSpec], col: Optional[OperandSpec]) -> bool:
    """Whether ``quantize_1d`` makes the copies in one pass: a 2-D x, 1d blocks, no RHT along the
    rowwise copy (None: no such copy)."""
    return (x.dim() == 2 and (row is None or (row.block == "1d" and not row.rht))
            and (col is None or col.block == "1d"))


def _quantize_copies(x: torch.Tensor, row: Optional[OperandSpec], col: Optional[OperandSpec],
                     inner: Tuple[bool, bool], seed, row_offset, col_offset, rht_signs,
                     b: Optional[NVFP4Data] = None):
    """quantize_1d of x's rowwise and columnwise copies (each None to skip; :func:`_one_pass`
    holds), those ``inner`` names as :class:`Inner` values, and the Inner values of ``b`` (a 1d
    operand or None) where the launch makes a columnwise copy for them to ride on. A transposed
    view x (``base.t()``) is read through base, its rows being base's columns (coalesced).
    Returns (rowwise, columnwise, b's Inner or None: b not given or not made)."""
    for t, spec in ((x, row), (x.t(), col)):
        if spec is not None:
            R.check_input(t, spec.block, spec.scaling, spec.rounding)
    signs = _signs(rht_signs, col) if col is not None else None
    r, c = [None if sp is None else _copy_spec(sp)._replace(inner=i)
            for sp, i in ((row, inner[0]), (col, inner[1]))]
    transposed = _is_transposed_view(x)
    if transposed:
        x, r, c, row_offset, col_offset = x.t(), c, r, col_offset, row_offset
    b_inner = deq = None
    if b is not None and c is not None:
        b_inner = Inner(torch.empty(b.qdata.shape[0], 2 * b.qdata.shape[1], dtype=torch.float16,
                                    device=x.device), b.outer_scale)
        deq = (b.qdata, b.scale, b_inner.values)
    out_r, out_c = quantize_1d(x, row=r, col=c, seed=seed, row_offset=row_offset,
                               col_offset=col_offset, signs=signs, dequantize=deq)
    return (out_c, out_r, b_inner) if transposed else (out_r, out_c, b_inner)


def _operand(q: Union[Quantized, Inner, None]):
    """A quantize_1d copy as a GEMM operand: NVFP4Data for codes, Inner as it is."""
    return _data(q) if isinstance(q, Quantized) else q

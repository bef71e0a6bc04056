"""The ``triton`` backend: NVFP4 quantization with the fused Triton kernels of ``kernels/``.

Gives the same bits as the reference backend (``Backend``) for every ``OperandSpec``; the GEMM is
the Triton NVFP4 GEMM of ``kernels/gemm.py``. Runs on CUDA GPUs and, for
tests, under ``TRITON_INTERPRET=1`` on the CPU. Nothing here synchronises with the host: amaxes stay
on the device and SR seeds/offsets may be device tensors.

Layout of the work (kernels/quantize.py): a 1D operand is an amax pass plus one quantize pass that
reads the (M, K) matrix once and writes the rowwise and/or columnwise copies; a 2D operand (weights)
is an amax pass plus one pass writing W and its exact transpose.

In NVFP4Linear (``linear_fprop``, ``linear_grads``) the copies a GEMM uses at once (X for fprop,
dY for dgrad, dY^T for wgrad) are written as fp16 inner values (codes x block scales) instead of
codes, so their GEMMs skip the dequantize pass of that operand (``gemm.inner_mm``); the values are
exactly those the dequantize pass would give, so the results are the same bits.
"""

from typing import Optional, Tuple

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
        if x.dim() != 2 or row.block != "1d" or col.block != "1d" or row.rht:
            return super().quantize_pair(x, row, col, seed, row_offset, col_offset, rht_signs)
        R.check_input(x, row.block, row.scaling, row.rounding)
        R.check_input(x.t(), col.block, col.scaling, col.rounding)
        signs = _signs(rht_signs, col)
        base, transposed = (x.t(), True) if _is_transposed_view(x) else (x, False)
        r, c = _copy_spec(row), _copy_spec(col)
        if transposed:  # rows of x are columns of base
            out_c, out_r = quantize_1d(base, row=c, col=r, seed=seed, row_offset=col_offset,
                                       col_offset=row_offset, signs=signs)
        else:
            out_r, out_c = quantize_1d(base, row=r, col=c, seed=seed, row_offset=row_offset,
                                       col_offset=col_offset, signs=signs)
        return _data(out_r), _data(out_c)

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

    def linear_fprop(self, x: torch.Tensor, w: NVFP4Data, w_block: str, x_spec: OperandSpec,
                     xt_spec: Optional[OperandSpec], bias: Optional[torch.Tensor],
                     out_dtype: torch.dtype, seed: R.IntOrTensor = 0,
                     rht_signs: Optional[torch.Tensor] = None,
                     ) -> Tuple[torch.Tensor, Optional[NVFP4Data]]:
        """``Backend.linear_fprop`` with X written as inner values (and X^T as codes) by one
        quantize pass; the same bits as the reference composition."""
        if not _inner_path(x, x_spec, xt_spec):
            return super().linear_fprop(x, w, w_block, x_spec, xt_spec, bias, out_dtype, seed,
                                        rht_signs)
        xr, xc = _quantize_pair(x, x_spec, xt_spec, (True, False), seed, 0, 0, rht_signs)
        return _inner_mm(xr, w, w_block, bias, out_dtype), None if xc is None else _data(xc)

    def linear_grads(self, dy: torch.Tensor, wt: Optional[NVFP4Data], xt: Optional[NVFP4Data],
                     w_block: str, dy_spec: OperandSpec, dyt_spec: OperandSpec,
                     dx_dtype: torch.dtype, dw_dtype: torch.dtype, seed: R.IntOrTensor = 0,
                     dy_offset: R.IntOrTensor = 0, dyt_offset: R.IntOrTensor = 0,
                     rht_signs: Optional[torch.Tensor] = None,
                     ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``Backend.linear_grads`` with dY and dY^T written as inner values by one quantize pass;
        the same bits as the reference composition."""
        row = dy_spec if wt is not None else None
        col = dyt_spec if xt is not None else None
        if not _inner_path(dy, row, col) or (row is None and col is None):
            return super().linear_grads(dy, wt, xt, w_block, dy_spec, dyt_spec, dx_dtype, dw_dtype,
                                        seed, dy_offset, dyt_offset, rht_signs)
        dyr, dyc = _quantize_pair(dy, row, col, (True, True), seed, dy_offset, dyt_offset,
                                  rht_signs)
        dx = None if dyr is None else _inner_mm(dyr, wt, w_block, None, dx_dtype)
        del dyr  # frees dY's inner values before the wgrad GEMM
        dw = None if dyc is None else _inner_mm(dyc, xt, "1d", None, dw_dtype)
        return dx, dw

    def _quantize_2d(self, x, spec, seed, offset, signs) -> NVFP4Data:
        if spec.rht:  # RHT along K with 16x16 blocks: no recipe asks for it; the reference does it
            warn_once("triton backend: 2d blocks with RHT run on the reference implementation")
            return super().quantize(x, spec, seed, offset, signs)
        sr = spec.rounding == "sr"
        if _is_transposed_view(x) and not sr:  # quantize_2d(x) is the exact transpose of that of x.t()
            return _data(quantize_2d(x.t(), amax_scale=spec.amax_scale, write_w=False)[1])
        return _data(quantize_2d(x, sr=sr, seed=seed, offset=offset, amax_scale=spec.amax_scale,
                                 write_wt=False)[0])


def _inner_path(x: torch.Tensor, row: Optional[OperandSpec], col: Optional[OperandSpec]) -> bool:
    """Whether the linear layer's inner-value path applies: a 2-D x, 1d copies with no RHT along
    the rowwise one, on a GPU with E4M3 conversion or under the interpreter."""
    if x.dim() != 2 or not (G._interpreting() or G.has_e4m3_convert(x.device)):
        return False
    return ((row is None or (row.block == "1d" and not row.rht))
            and (col is None or col.block == "1d"))


def _quantize_pair(x: torch.Tensor, row: Optional[OperandSpec], col: Optional[OperandSpec],
                   inner: Tuple[bool, bool], seed, row_offset, col_offset, rht_signs):
    """quantize_1d of x's rowwise and columnwise copies (each None to skip), those ``inner``
    names as :class:`Inner` values; a transposed view x is read through its base."""
    for t, spec in ((x, row), (x.t(), col)):
        if spec is not None:
            R.check_input(t, spec.block, spec.scaling, spec.rounding)
    signs = _signs(rht_signs, col) if col is not None else None
    specs = [None if sp is None else _copy_spec(sp)._replace(inner=i)
             for sp, i in ((row, inner[0]), (col, inner[1]))]
    if _is_transposed_view(x) and specs[0] is not None and specs[1] is not None:
        c, r = quantize_1d(x.t(), row=specs[1], col=specs[0], seed=seed, row_offset=col_offset,
                           col_offset=row_offset, signs=signs)
        return r, c
    return quantize_1d(x, row=specs[0], col=specs[1], seed=seed, row_offset=row_offset,
                       col_offset=col_offset, signs=signs)


def _inner_mm(a: Inner, b: NVFP4Data, b_block: str, bias, out_dtype) -> torch.Tensor:
    """A_inner @ B^T with B dequantized (one pass) and the outer scales in the epilogue."""
    b_inner = G.dequantize_inner(b.qdata, b.scale, b_block, out_dtype=torch.float16)
    return G.inner_mm(a.values, a.outer_scale, b_inner, b.outer_scale, bias=bias,
                      out_dtype=out_dtype)

"""The Triton backend: NVFP4 quantization with the fused kernels of ``kernels/`` and the Triton GEMM.

Gives the reference backend's bits for every :class:`QuantSpec`. Runs on CUDA GPUs and, for tests,
under ``TRITON_INTERPRET=1`` on the CPU. Nothing here synchronises with the host: amaxes stay on the
device and SR seeds/offsets may be device tensors.

Work layout (``kernels/quantize.py``): a 1D operand is an amax pass plus one quantize pass that reads
the (M, K) matrix once and writes its rowwise and/or columnwise copies; a 2D operand (weights) is an
amax pass plus one pass writing W and its exact transpose. What this backend adds to the primitives:

- Transient copies (a GEMM uses them at once: X and W for fprop, dY for dgrad, dY^T for wgrad) are
  written as fp16 inner values (codes x block scales), so their GEMM skips a dequantize pass
  (GPUs with E4M3 conversion, sm89+, and the interpreter).
- ``quantize_pair(..., prepare=b)`` dequantizes b (wgrad's X^T) in the same launch as the pair:
  its memory traffic overlaps that pass's arithmetic.
- While a CUDA graph is captured, :meth:`prepare_weight` and :meth:`prepare` run on a side stream
  (``streams.SideStream``) beside the activations' passes, and their join is deferred to the
  primitive that reads their outputs: every primitive first joins the forks its arguments read
  (``streams.joins_reads``): :meth:`mm` and :meth:`grouped_mm` their operands, a quantize pass
  its ``prepare=`` operand, :meth:`prepare` its b.
"""

from typing import Optional, Tuple

import torch

from .. import reference as R
from ..kernels import amax, expert_weights, gemm, grouped_gemm, grouped_quantize, transpose
from ..kernels.dequantize import dequantize_inner
from ..kernels.quantize import amax_pass, quantize_1d, quantize_2d
from ..kernels.runtime import inner_values_supported, interpreting
from ..operand import NVFP4Operand
from ..spec import Block, Form, QuantSpec
from ..streams import SideStream, joins_reads
from . import (AmaxReduce, Backend, IntOrTensor, quantize_each, reduced_amax, register_backend,
               warn_once)
from . import grouped
from .reference import ReferenceBackend

_REFERENCE = ReferenceBackend()


def _is_transposed_view(x: torch.Tensor) -> bool:
    """True for a 2-D non-contiguous x whose transpose is contiguous (x = base.t())."""
    return x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous()


def _reduced_amaxes(x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec],
                    signs: Optional[torch.Tensor], reduce: Tuple[AmaxReduce, AmaxReduce]):
    """The ``amaxes`` argument of ``quantize_1d(x, row, col)``: None (the kernel's own amax pass)
    without a reducer, else per copy its reduced amax (``backends.reduced_amax``) or, without a
    reducer, the amax pass's; the pass runs unless every copy's amax is given as a tensor."""
    if reduce == (None, None):
        return None
    specs = (row, col)
    if all(s is None or isinstance(f, torch.Tensor) for s, f in zip(specs, reduce)):
        return reduce
    if any(s is not None and s.rht and s.amax_scale is None for s in specs):
        signs = signs.to(device=x.device, dtype=torch.float32).contiguous()
    amaxes = amax_pass(x, row, col, signs)
    return tuple(a if f is None or a is None else reduced_amax(f, lambda a=a: a)
                 for a, f in zip(amaxes, reduce))


def _one_pass(x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec]) -> bool:
    """Whether ``quantize_1d`` makes the copies in one pass: a 2-D x, 1d blocks, no RHT along the
    rowwise copy (None: no such copy; an RHT along K runs in the rowwise-only kernel)."""
    return (x.dim() == 2 and (row is None or (row.block is Block.D1 and not row.rht))
            and (col is None or col.block is Block.D1))


@register_backend
@joins_reads(Backend.PRIMITIVES)
class TritonBackend(Backend):
    """Fused Triton quantization kernels and the Triton NVFP4 GEMM (sm80/sm90; the interpreter)."""

    name = "triton"
    # the grouped GEMM stays opaque: it makes host-side TMA descriptors, which a recorded launch
    # would drop
    traced = () if interpreting() else tuple(p for p in Backend.PRIMITIVES if p != "grouped_mm")
    fakes = {"grouped_mm": grouped.fake_grouped_mm}

    def quantize(self, x: torch.Tensor, spec: QuantSpec, *, seed: IntOrTensor = 0,
                 offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                 amax_reduce: AmaxReduce = None) -> NVFP4Operand:
        """A 2-D ``x`` that is the transpose view of a contiguous matrix (``base.t()``) is read
        through the columnwise path of ``base`` (coalesced); other layouts are read as they are.
        Raises: TypeError / ValueError as ``reference.check_input``."""
        R.check_input(x, spec)
        if spec.rht and signs is None:
            raise ValueError("an RHT operand needs rht_signs")
        if x.numel() == 0:  # nothing to launch a kernel for
            return _REFERENCE.quantize(x, spec, seed=seed, offset=offset, signs=signs,
                                       amax_reduce=amax_reduce)
        if spec.block is Block.D2:
            return self._quantize_2d(x, spec, seed, offset, signs, amax_reduce)
        if _is_transposed_view(x):
            return self._columnwise(x.t(), spec, seed, offset, signs, amax_reduce)
        lead, (m, k) = x.shape[:-2], x.shape[-2:]
        x2 = x.reshape(-1, k)
        q = quantize_1d(x2, row=spec, seed=seed, row_offset=offset, signs=signs,
                        amaxes=_reduced_amaxes(x2, spec, None, signs, (amax_reduce, None)))[0]
        outer = q.outer_scale.reshape(*lead, m) if spec.per_token else q.outer_scale
        return q._replace(qdata=q.qdata.reshape(*lead, m, k // 2),
                          scale=q.scale.reshape(*lead, m, k // 16), outer_scale=outer)

    def quantize_pair(self, x, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                      transient=(False, False), prepare=None, amax_reduce=(None, None)):
        """One read of x for both copies where ``quantize_1d`` takes them (2-D x, 1d blocks, no RHT
        on the rowwise copy); a transposed view x (``base.t()``) is read through base, its rows
        being base's columns (coalesced). Other cases make two :meth:`quantize` calls."""
        if (row is None and col is None) or not _one_pass(x, row, col):
            r, c = quantize_each(self, x, row, col, seed, row_offset, col_offset, signs,
                                 amax_reduce)
            return r, c, None if prepare is None else self._dequantized(prepare)
        inner = transient if inner_values_supported(x.device) else (False, False)
        specs, offsets, reduce = [row, col], [row_offset, col_offset], tuple(amax_reduce)
        if _is_transposed_view(x):  # x^T's rowwise copy is x's columnwise one
            x, specs, offsets, inner = x.t(), specs[::-1], offsets[::-1], inner[::-1]
            reduce = reduce[::-1]
            transposed = True
        else:
            transposed = False
        rider = None
        if prepare is not None and specs[1] is not None and inner_values_supported(x.device):
            out = torch.empty(prepare.rows, prepare.k, dtype=torch.float16, device=x.device)
            rider = (prepare, out)
        r, c = quantize_1d(x, specs[0], specs[1], inner=inner, seed=seed, row_offset=offsets[0],
                           col_offset=offsets[1], signs=signs, dequantize=rider,
                           amaxes=_reduced_amaxes(x, specs[0], specs[1], signs, reduce))
        if transposed:
            r, c = c, r
        if prepare is None:
            return r, c, None
        if rider is None:  # no columnwise copy in that launch to ride on
            return r, c, self._dequantized(prepare)
        return r, c, prepare._replace(qdata=None, scale=None, values=rider[1])

    def prepare_weight(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                       amax_reduce: AmaxReduce = None,
                       ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """2d: W and W^T from one read; 1d: the pair kernel. W comes back as the fp16 inner values
        fprop's GEMM reads where the GPU converts E4M3 (W^T stays codes, kept for backward).
        While a CUDA graph is captured, this runs on the side stream."""
        with SideStream(w.device) as side:
            if spec.block is Block.D2 and not spec.rht:
                R.check_input(w, spec)
                wq, wtq = quantize_2d(w, spec, write_wt=need_t,
                                      amax=_reduced_2d_amax(w, amax_reduce),
                                      inner=inner_values_supported(w.device))
            elif spec.block is Block.D1 and not spec.rht:
                wq, wtq, _ = self.quantize_pair(w, spec, spec if need_t else None,
                                                transient=(True, False),
                                                amax_reduce=(amax_reduce, amax_reduce))
            else:
                wq, wtq = _REFERENCE.prepare_weight(w, spec, need_t=need_t,
                                                    amax_reduce=amax_reduce)
            if side.forked:
                wq = self._dequantized(wq)
        side.defer_join(wq, wtq)
        return wq, wtq

    def prepare(self, b: NVFP4Operand) -> NVFP4Operand:
        """While a CUDA graph is captured: b's inner values, made on the side stream; otherwise b
        (:meth:`mm` dequantizes it right before the product)."""
        with SideStream(b.device) as side:
            if side.forked:
                b = self._dequantized(b)
        side.defer_join(b)
        return b

    def transpose_2d(self, b: NVFP4Operand) -> NVFP4Operand:
        """``kernels.transpose.transpose_2d``: one launch."""
        return transpose.transpose_2d(b)

    def mm(self, a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``kernels.gemm.scaled_mm``."""
        return gemm.scaled_mm(a, b, bias=bias, out_dtype=out_dtype)

    def quantize_groups(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                        transient=(False, False), prepare=None):
        """One launch for all groups (``kernels.grouped_quantize.quantize_grouped``); ``prepare``
        (codes) is dequantized to fp16 inner values in the launch that writes the columnwise copy
        (its memory traffic overlaps that pass's arithmetic), or left to :meth:`grouped_mm` when
        there is none."""
        grouped.check_quantize_args(x, row, col, signs)
        supported = inner_values_supported(x.device)
        inner = transient if supported else (False, False)
        ride = (prepare is not None and prepare.form is Form.CODES and col is not None
                and supported)
        rider = None
        if ride:
            n_groups, rows, half = prepare.qdata.shape
            rider = (grouped_gemm.stacked_codes(prepare),
                     torch.empty(n_groups * rows, 2 * half, dtype=torch.float16, device=x.device))
        r, c = grouped_quantize.quantize_grouped(x, offs, row, col, inner=inner, seed=seed,
                                                 row_offset=row_offset, col_offset=col_offset,
                                                 signs=signs, dequantize=rider)
        if ride:
            prepare = prepare._replace(qdata=None, scale=None,
                                       values=rider[1].view(n_groups, rows, 2 * half))
        return r, c, prepare

    def quantize_experts(self, w, spec, *, need_t, transient=False):
        """``kernels.expert_weights.quantize_experts``: W as fp16 inner values when transient
        (sm89+)."""
        grouped.check_experts(w, spec)
        return expert_weights.quantize_experts(w, spec, write_wt=need_t,
                                               inner=transient and inner_values_supported(w.device))

    def grouped_mm(self, a, b, *, out_dtype=torch.float32):
        """``kernels.grouped_gemm.grouped_scaled_mm``."""
        return grouped_gemm.grouped_scaled_mm(a, b, out_dtype=out_dtype)

    def _dequantized(self, b: NVFP4Operand) -> NVFP4Operand:
        """b with its fp16 inner values in place of its codes (where the GEMM takes them)."""
        if b.form is Form.VALUES or not inner_values_supported(b.device):
            return b
        return b._replace(qdata=None, scale=None, values=dequantize_inner(b, torch.float16))

    @staticmethod
    def _columnwise(base, spec, seed, offset, signs, amax_reduce) -> NVFP4Operand:
        """The quantization of base^T: the columnwise copy of ``quantize_1d(base)``."""
        amaxes = _reduced_amaxes(base, None, spec, signs, (None, amax_reduce))
        return quantize_1d(base, col=spec, seed=seed, col_offset=offset, signs=signs,
                           amaxes=amaxes)[1]

    def _quantize_2d(self, x, spec, seed, offset, signs, amax_reduce) -> NVFP4Operand:
        if spec.rht:  # RHT along K with 16x16 blocks: no recipe asks for it; the reference does it
            warn_once("triton backend: 2d blocks with RHT run on the reference implementation")
            return _REFERENCE.quantize(x, spec, seed=seed, offset=offset, signs=signs,
                                       amax_reduce=amax_reduce)
        amax_ = _reduced_2d_amax(x, amax_reduce)
        # quantize_2d(x) is the exact transpose of x.t()'s, but for SR's bits and 4/6's error
        # sums (the order of a tile's additions)
        if _is_transposed_view(x) and not spec.sr and spec.four_over_six is None:
            return quantize_2d(x.t(), spec, write_w=False, amax=amax_)[1]
        return quantize_2d(x, spec, seed=seed, offset=offset, write_wt=False, amax=amax_)[0]


def _reduced_2d_amax(w: torch.Tensor, amax_reduce: AmaxReduce) -> Optional[torch.Tensor]:
    """The ``amax`` argument of ``quantize_2d(w)``: None (its own pass) without a reducer."""
    return reduced_amax(amax_reduce, lambda: amax.amax(w, amax.TENSOR, amax.NONE)[0])

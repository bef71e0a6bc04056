"""The grouped (mixture-of-experts) primitives of each backend: token-group quantization, per-expert
weight quantization and the grouped GEMM (docs/moe.md).

- ``reference``: per-group calls of ``reference.quantize`` and ``reference.scaled_mm``; the oracle.
- ``triton``: the kernels of ``kernels/grouped.py`` (one launch quantizes all groups; one
  persistent grouped GEMM), on CUDA GPUs and under the Triton interpreter.
- ``native`` (sm100+, untested on hardware): the Triton quantization and, for fprop and dgrad
  with per-group outer scales and a bf16 output, ``torch.nn.functional.scaled_grouped_mm`` on FP4
  tensor cores; the other GEMMs run the Triton grouped GEMM.

:func:`get_grouped_backend` follows :func:`backends.get_backend` ("auto", fallbacks logged once).
Seeds and offsets may be ints or device int64 scalars, as for the dense primitives.
"""

import os
from typing import Optional, Tuple, Union

import torch

from .. import reference as R
from ..formats import BLOCK
from ..operand import GroupedOperand, NVFP4Operand
from ..spec import Block, QuantSpec
from . import IntOrTensor, get_backend, warn_once
from .operators import register_methods

Offsets = Tuple[Tuple[int, int], ...]
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def check_offsets(offs: torch.Tensor, rows: int) -> None:
    """Validate group ends against the contract of the grouped primitives (one host sync).

    Raises:
        TypeError: offs not a 1-D int32 tensor.
        ValueError: a group with a negative length or a length that is not a multiple of 16
            (naming the group and its length; pad each expert's tokens to a multiple of 16, as
            ``moe.pad_groups`` does), or ``offs[-1]`` past the ``rows`` rows.
    """
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"offs must be a 1-D int32 tensor of cumulative group ends, got "
                        f"{getattr(offs, 'dtype', type(offs).__name__)}")
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end < start or (end - start) % BLOCK:
            raise ValueError(f"group {g} has {end - start} tokens (offs[{g}] = {end}); every group "
                             f"needs a length that is a multiple of {BLOCK} (NVFP4's wgrad blocks "
                             f"run along the tokens): pad each expert's tokens")
        start = end
    if start > rows:
        raise ValueError(f"the groups end at row {start}, past the {rows} rows of the operand")


def group_bounds(offs: torch.Tensor) -> Offsets:
    """((start, end) of each group) from the device offsets (a host sync)."""
    ends = offs.tolist()
    return tuple(zip([0] + ends[:-1], ends))


def group_slice(op: GroupedOperand, g: int, start: int, end: int) -> NVFP4Operand:
    """Group g of a grouped operand as the dense operand of its tokens (rows [start, end) of a
    rows-grouped operand, or the (R, end - start) columns of one grouped along K)."""
    d = op.data
    if op.along_k:
        cols = lambda t, unit: None if t is None else t[:, start // unit:end // unit]
        outer = d.outer_scale[g]
        return NVFP4Operand(cols(d.qdata, 2), cols(d.scale, BLOCK), outer, Block.D1,
                            cols(d.values, 1))
    rows = lambda t: None if t is None else t[start:end]
    outer = d.outer_scale[start:end] if op.per_token else d.outer_scale[g]
    return NVFP4Operand(rows(d.qdata), rows(d.scale), outer, Block.D1, rows(d.values))


def expert_slice(op: NVFP4Operand, g: int) -> NVFP4Operand:
    """Expert g of a stacked (G, N, K) expert operand."""
    return NVFP4Operand(None if op.qdata is None else op.qdata[g],
                        None if op.scale is None else op.scale[g], op.outer_scale[g], op.block,
                        None if op.values is None else op.values[g])


def check_quantize_args(x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec],
                        signs: Optional[torch.Tensor]) -> None:
    """The checks every backend's :meth:`GroupedBackend.quantize` makes (``reference.check_input``
    on both copies, 1d specs, no rowwise RHT, signs for an RHT copy).

    Raises:
        TypeError, ValueError: naming the problem.
    """
    if x.dim() != 2:
        raise ValueError(f"token groups are a 2-D (tokens, K) tensor, got shape {tuple(x.shape)}")
    for spec, t, name in ((row, x, "row"), (col, x.t(), "col")):
        if spec is None:
            continue
        if spec.block is not Block.D1:
            raise ValueError(f"token groups are quantized in 1d blocks; {name} has "
                             f"{spec.block.value} blocks")
        R.check_input(t, spec)
    if row is not None and row.rht:
        raise ValueError("the rowwise copy of token groups takes no RHT (the recipe applies it to "
                         "the wgrad copies, along the tokens)")
    if col is not None and col.rht and signs is None:
        raise ValueError("an RHT copy needs the 16 RHT signs")


class GroupedBackend:
    """The reference implementation of the grouped primitives; subclasses override them.

    Every backend gives the reference's bits for quantization and its GEMMs up to the fp32
    accumulation order.
    """

    name = "reference"

    def quantize(self, x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec],
                 col: Optional[QuantSpec], *, seed: IntOrTensor = 0, row_offset: IntOrTensor = 0,
                 col_offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                 transient: Tuple[bool, bool] = (False, False),
                 prepare: Optional[NVFP4Operand] = None,
                 ) -> Tuple[Optional[GroupedOperand], Optional[GroupedOperand], Optional[NVFP4Operand]]:
        """The rowwise copy of the token groups of x (T, K) under ``row`` and the columnwise copy
        (each group's x_g^T) under ``col``, each None to skip; one outer scale per group (or per
        token). SR streams per group as in ``kernels/grouped.py``; ``transient[i]``: copy i only
        feeds the next :meth:`mm` and may come back as inner values. ``prepare``: a stacked
        expert operand (G, R, C) that a later :meth:`mm` takes as B (dgrad's W^T); the backend
        may prepare it in the same pass. Returns (rowwise, columnwise, prepared ``prepare``).

        Here: ``reference.quantize`` on each group, ``x[s:e]`` with counter base
        ``row_offset + s * K / 16`` and ``x[s:e].t()`` with ``col_offset + s * K / 16``.

        Raises:
            TypeError, ValueError: see :func:`check_quantize_args`.
        """
        check_quantize_args(x, row, col, signs)
        bounds = group_bounds(offs)
        rows = cols = None
        if row is not None:
            rows = _assemble_rows(x, offs, bounds, row,
                                  _per_group(x, bounds, row, False, seed, row_offset, signs))
        if col is not None:
            cols = _assemble_cols(x, offs, bounds, col,
                                  _per_group(x, bounds, col, True, seed, col_offset, signs))
        return rows, cols, prepare

    def quantize_experts(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                         transient: bool = False) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """Expert weights (G, N, K), each W_g quantized alone under ``spec`` (per-tensor, no
        RHT), and with ``need_t`` each W_g^T (for 2d blocks the exact transpose, for 1d W_g^T
        quantized along N): stacked operands (G, N, K) and (G, K, N), outer (G,).
        ``transient``: W only feeds the next :meth:`mm` and may come back as inner values."""
        _check_experts(w, spec)
        n_groups, n, k = w.shape
        ws, wts = [], []
        for g in range(n_groups):
            wq = R.quantize(w[g], spec, offset=g * n * k // BLOCK)
            ws.append(wq)
            if need_t:
                wts.append(R.transpose_2d(wq) if spec.block is Block.D2 else
                           R.quantize(w[g].t(), spec, offset=g * n * k // BLOCK))
        return _stack(ws, w.device), (_stack(wts, w.device) if need_t else None)

    def mm(self, a: GroupedOperand, b: Union[NVFP4Operand, GroupedOperand], *,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The grouped GEMM: with ``b`` a stacked (G, N, K) expert operand (fprop, dgrad),
        ``D[r] = s_a * s_b[g] * A_inner[r] @ B_inner[g]^T`` for the rows r of group g, (T, N);
        with ``b`` grouped along K like ``a`` (wgrad), ``D[g] = s_a * s_b * A_g @ B_g^T`` over
        each group's tokens, (G, M, N). Rows past the last group are zeros. Here:
        ``reference.scaled_mm`` of each group."""
        bounds = group_bounds(a.offs)
        if isinstance(b, GroupedOperand):
            m, n = a.data.rows, b.data.rows
            out = torch.zeros(a.groups, m, n, dtype=out_dtype, device=a.data.device)
            for g, (s, e) in enumerate(bounds):
                out[g] = R.scaled_mm(group_slice(a, g, s, e), group_slice(b, g, s, e),
                                     out_dtype=out_dtype)
            return out
        out = torch.zeros(a.data.rows, _expert_rows(b), dtype=out_dtype, device=a.data.device)
        for g, (s, e) in enumerate(bounds):
            out[s:e] = R.scaled_mm(group_slice(a, g, s, e), expert_slice(b, g), out_dtype=out_dtype)
        return out


def _per_group(x, bounds, spec, transpose, seed, base, signs):
    """``reference.quantize`` of each group's tokens (or their transpose), the group starting at
    row s taking counter base ``base + s * K / 16``."""
    k = x.shape[1]
    return [R.quantize(x[s:e].t() if transpose else x[s:e], spec, seed=seed,
                       offset=base + s * k // BLOCK, rht_signs=signs) for s, e in bounds]


def _expert_rows(b: NVFP4Operand) -> int:
    return (b.values if b.qdata is None else b.qdata).shape[1]


def _check_experts(w: torch.Tensor, spec: QuantSpec) -> None:
    if w.dim() != 3:
        raise ValueError(f"expert weights must be (G, N, K), got shape {tuple(w.shape)}")
    if spec.per_token or spec.rht:
        raise ValueError(f"expert weights take a per-tensor spec without RHT, got {spec}")
    for g in range(min(1, w.shape[0])):
        R.check_input(w[g], spec)


def _stack(ops, device) -> NVFP4Operand:
    """Per-expert operands stacked along a new first dimension (outer scales (G,))."""
    if not ops:
        raise ValueError("no experts: expert weights need G >= 1")
    return NVFP4Operand(torch.stack([o.qdata for o in ops]), torch.stack([o.scale for o in ops]),
                        torch.stack([o.outer_scale for o in ops]), ops[0].block)


def _assemble_rows(x, offs, bounds, spec, parts) -> GroupedOperand:
    """The rowwise copies of the groups as one (T, K) operand (rows past the groups: zeros)."""
    m, k = x.shape
    qdata = torch.zeros(m, k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(m, k // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    outer = torch.zeros(m, dtype=torch.float32, device=x.device) if spec.per_token else \
        torch.stack([p.outer_scale for p in parts]) if parts else x.new_zeros(0, dtype=torch.float32)
    for (s, e), p in zip(bounds, parts):
        qdata[s:e], scale[s:e] = p.qdata, p.scale
        if spec.per_token:
            outer[s:e] = p.outer_scale
    return GroupedOperand(NVFP4Operand(qdata, scale, outer), offs, False, spec.per_token)


def _assemble_cols(x, offs, bounds, spec, parts) -> GroupedOperand:
    """The columnwise copies x_g^T (K, M_g) side by side as one (K, T) operand."""
    m, k = x.shape
    qdata = torch.zeros(k, m // 2, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(k, m // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    for (s, e), p in zip(bounds, parts):
        qdata[:, s // 2:e // 2], scale[:, s // BLOCK:e // BLOCK] = p.qdata, p.scale
    shape = (0, k) if spec.per_token else (0,)
    outer = torch.stack([p.outer_scale for p in parts]) if parts else \
        torch.zeros(shape, dtype=torch.float32, device=x.device)
    return GroupedOperand(NVFP4Operand(qdata, scale, outer), offs, True, spec.per_token)


class TritonGrouped(GroupedBackend):
    """The grouped kernels of ``kernels/grouped.py``; transient copies as fp16 inner values where
    the GPU converts E4M3 (sm89+) and under the interpreter."""

    name = "triton"

    def quantize(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                 transient=(False, False), prepare=None):
        """As the reference's; ``prepare`` (codes) is dequantized to fp16 inner values in the
        launch that writes the columnwise copy (its memory traffic overlaps that pass's
        arithmetic), or left to :meth:`mm` when there is none."""
        from ..kernels.grouped import quantize_grouped, stacked_codes
        from ..kernels.runtime import inner_values_supported
        check_quantize_args(x, row, col, signs)
        supported = inner_values_supported(x.device)
        inner = transient if supported else (False, False)
        ride = prepare is not None and prepare.values is None and col is not None and supported
        rider = None
        if ride:
            n_groups, rows, half = prepare.qdata.shape
            rider = (stacked_codes(prepare),
                     torch.empty(n_groups * rows, 2 * half, dtype=torch.float16, device=x.device))
        r, c = quantize_grouped(x, offs, row, col, inner=inner, seed=seed, row_offset=row_offset,
                                col_offset=col_offset, signs=signs, dequantize=rider)
        if ride:
            prepare = prepare._replace(qdata=None, scale=None,
                                       values=rider[1].view(n_groups, rows, 2 * half))
        return r, c, prepare

    def quantize_experts(self, w, spec, *, need_t, transient=False):
        from ..kernels.grouped import quantize_experts
        from ..kernels.runtime import inner_values_supported
        _check_experts(w, spec)
        return quantize_experts(w, spec, write_wt=need_t,
                                inner=transient and inner_values_supported(w.device))

    def mm(self, a, b, *, out_dtype=torch.float32):
        from ..kernels.grouped import grouped_scaled_mm
        return grouped_scaled_mm(a, b, out_dtype=out_dtype)


class NativeGrouped(TritonGrouped):
    """sm100+: ``F.scaled_grouped_mm`` (FP4 tensor cores, CUTLASS through MSLK/FBGEMM) for the GEMMs
    it can take with one rounding, the Triton kernels for the rest (``native_grouped_mm``)."""

    name = "native"

    def quantize(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                 transient=(False, False), prepare=None):
        """As the Triton backend's, but a rowwise copy with per-group outer scales (fprop's X,
        dgrad's dY) stays codes, transient or not, and ``prepare`` is left as it is:
        ``F.scaled_grouped_mm`` reads codes, and those are what it takes (``native_unsupported``)."""
        if row is not None and not row.per_token:
            transient = (False, transient[1])
        r, c, _ = super().quantize(x, offs, row, col, seed=seed, row_offset=row_offset,
                                   col_offset=col_offset, signs=signs, transient=transient)
        return r, c, prepare

    def quantize_experts(self, w, spec, *, need_t, transient=False):
        """As the Triton backend's, but W stays codes (what ``F.scaled_grouped_mm`` reads)."""
        return super().quantize_experts(w, spec, need_t=need_t)

    def mm(self, a, b, *, out_dtype=torch.float32):
        why = native_unsupported(a, b, out_dtype)
        if why:
            warn_once(f"native grouped NVFP4 GEMM: {why}; using the Triton grouped GEMM for such "
                      f"GEMMs (logged once)", key="native-grouped-" + why)
            return super().mm(a, b, out_dtype=out_dtype)
        return native_grouped_mm(a, b)


def native_unsupported(a: GroupedOperand, b, out_dtype: torch.dtype) -> str:
    """Why ``F.scaled_grouped_mm`` cannot compute this grouped GEMM exactly ('' if it can): it
    takes one global scale per group and operand and returns bf16 only, so per-token outer
    scales or another output dtype would round twice; wgrad (2d x 2d) is not wired up."""
    if isinstance(b, GroupedOperand):
        return "wgrad (groups along K) is not wired to scaled_grouped_mm"
    if a.per_token:
        return "per-token outer scales cannot be one global scale per group"
    if out_dtype != torch.bfloat16:
        return f"scaled_grouped_mm returns bfloat16 only, {out_dtype} was asked"
    if a.data.qdata is None or b.qdata is None:
        return "an operand holds inner values, not codes"
    if a.data.k % 32:
        return f"K = {a.data.k} is not a multiple of 32"
    return ""


def blocked_group_scales(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales (T, K/16) of a rows-grouped operand in the layout
    ``scaled_grouped_mm`` takes for a 2-D A (torchao's ``torch_to_blocked_2d_M_groups``): each
    group's rows padded to a multiple of 128 and laid out with ``to_blocked``, groups one after
    another. Built on the device without the group sizes on the host: (T + 128 G) rows of
    ceil(K/64) * 4 columns, zero padding."""
    from torchao.prototype.mx_formats.utils import to_blocked

    t, cols = scale.shape
    n_groups = offs.shape[0]
    ends = offs.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + 127) // 128 * 128
    starts, pstarts = ends - sizes, torch.cumsum(padded, 0) - padded
    group = torch.repeat_interleave(torch.arange(n_groups, device=scale.device), sizes,
                                    output_size=t) if n_groups else sizes
    dest = torch.arange(t, device=scale.device) - starts[group] + pstarts[group]
    rows = (t + 127) // 128 * 128 + 128 * n_groups
    buf = torch.zeros(rows, cols, dtype=torch.uint8, device=scale.device)
    buf.index_copy_(0, dest, scale.view(torch.uint8))
    out_cols = (cols + 3) // 4 * 4
    return to_blocked(buf).view(rows, out_cols).view(torch.float8_e4m3fn)


def native_grouped_mm(a: GroupedOperand, b: NVFP4Operand) -> torch.Tensor:
    """fprop/dgrad on FP4 tensor cores: ``F.scaled_grouped_mm`` with NVFP4 operands (block scales
    ``BlockWise1x16`` in the swizzled 32x4x4 layout, the per-group outer scales as the
    ``TensorWise`` global scales, whose product scales each group's fp32 accumulator before its one
    rounding to bf16). UNTESTED ON HARDWARE (docs/moe.md): the CPU tests replace the call by an
    emulation of its documented semantics.

    Raises:
        ValueError: the operands are not on an sm100+ GPU.
    """
    import torch.nn.functional as F
    from .native import fp4_tensor_cores, swizzle_scales

    if not fp4_tensor_cores(a.data.device):
        raise ValueError(f"the native grouped NVFP4 GEMM needs an sm100+ GPU, got {a.data.device}")
    fp4 = torch.float4_e2m1fn_x2
    n_groups = b.qdata.shape[0]
    b_scales = torch.stack([swizzle_scales(b.scale[g], b.block) for g in range(n_groups)])
    rec, swz = F.ScalingType, F.SwizzleType
    return F.scaled_grouped_mm(
        a.data.qdata.view(fp4), b.qdata.view(fp4).transpose(-2, -1),
        [blocked_group_scales(a.data.scale, a.offs), a.data.outer_scale],
        [rec.BlockWise1x16, rec.TensorWise],
        [b_scales, b.outer_scale], [rec.BlockWise1x16, rec.TensorWise],
        swizzle_a=[swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE], swizzle_b=[swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE],
        offs=a.offs, output_dtype=torch.bfloat16)


def _fake_groups(x: torch.Tensor, offs: torch.Tensor, spec: QuantSpec, along_k: bool) -> GroupedOperand:
    """The shapes of the reference's copy of the token groups under ``spec`` (codes)."""
    m, k = x.shape
    rows, cols = (k, m) if along_k else (m, k)
    n_groups = offs.shape[0]
    if spec.per_token:
        outer = (n_groups, k) if along_k else (m,)
    else:
        outer = (n_groups,)
    data = NVFP4Operand(x.new_empty(rows, cols // 2, dtype=torch.uint8),
                        x.new_empty(rows, cols // BLOCK, dtype=torch.float8_e4m3fn),
                        x.new_empty(outer, dtype=torch.float32))
    return GroupedOperand(data, offs, along_k, spec.per_token)


def _fake_quantize(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                   transient=(False, False), prepare=None):
    """:meth:`GroupedBackend.quantize` on fake tensors (its body reads the group bounds)."""
    return (None if row is None else _fake_groups(x, offs, row, False),
            None if col is None else _fake_groups(x, offs, col, True), prepare)


def _fake_mm(self, a, b, *, out_dtype=torch.float32):
    """:meth:`GroupedBackend.mm` on fake tensors (its body reads the group bounds)."""
    if isinstance(b, GroupedOperand):
        return a.data.outer_scale.new_empty(a.groups, a.data.rows, b.data.rows, dtype=out_dtype)
    return a.data.outer_scale.new_empty(a.data.rows, _expert_rows(b), dtype=out_dtype)


_GROUPED = {"reference": GroupedBackend(), "triton": TritonGrouped(), "native": NativeGrouped()}
_PRIMITIVES = ("quantize", "quantize_experts", "mm")
# The grouped GEMM stays opaque everywhere: it makes host-side TMA descriptors, which a recorded
# launch would drop. Triton's quantize kernels are traced on a GPU.
_TRACED = {"reference": (), "triton": () if _INTERPRET else ("quantize", "quantize_experts"),
           "native": ("quantize", "quantize_experts")}
_FAKES = {"reference": {"quantize": _fake_quantize, "mm": _fake_mm}, "triton": {"mm": _fake_mm},
          "native": {"mm": _fake_mm}}
for _name, _backend in _GROUPED.items():
    register_methods(type(_backend), _backend, _PRIMITIVES, f"grouped_{_name}",
                     traced=_TRACED[_name], fakes=_FAKES[_name])


def get_grouped_backend(name: str, device: torch.device) -> GroupedBackend:
    """The grouped primitives of backend ``name`` ("auto" or a name, resolved and checked by
    :func:`backends.get_backend`) on ``device``.

    Raises:
        ValueError: as ``get_backend``.
    """
    return _GROUPED[get_backend(name, device).name]


def resolved_grouped(name: str) -> GroupedBackend:
    """The grouped primitives of a resolved backend name (``backends.get_backend(...).name``):
    a dict lookup that torch.compile traces."""
    return _GROUPED[name]

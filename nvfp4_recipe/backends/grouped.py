"""Grouped (mixture-of-experts) operands: the checks and slicing every backend shares, and the
reference implementation of the grouped primitives of :class:`backends.Backend` (token-group
quantization, per-expert weight quantization and the grouped GEMM; docs/moe.md): per-group calls
of ``reference.quantize`` and ``reference.scaled_mm``, the oracle of the grouped kernels. They read
the group bounds on the host, so their fakes (:func:`fake_quantize_groups`,
:func:`fake_grouped_mm`) give the shapes for torch.compile. Seeds and offsets may be ints or
device int64 scalars, as for the dense primitives.
"""

from typing import Optional, Tuple, Union

import torch

from .. import reference as R
from ..formats import BLOCK
from ..operand import GroupedOperand, NVFP4Operand
from ..spec import Block, Form, QuantSpec

IntOrTensor = R.IntOrTensor

Offsets = Tuple[Tuple[int, int], ...]


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
    rows-grouped operand, or the (R, end - start) columns of one grouped along K), with its spec."""
    d = op.data
    if op.along_k:
        cols = lambda t, unit: None if t is None else t[:, start // unit:end // unit]
        outer = d.outer_scale[g]
        return NVFP4Operand(cols(d.qdata, 2), cols(d.scale, BLOCK), outer, d.spec,
                            cols(d.values, 1))
    rows = lambda t: None if t is None else t[start:end]
    outer = d.outer_scale[start:end] if op.per_token else d.outer_scale[g]
    return NVFP4Operand(rows(d.qdata), rows(d.scale), outer, d.spec, rows(d.values))


def expert_slice(op: NVFP4Operand, g: int) -> NVFP4Operand:
    """Expert g of a stacked (G, N, K) expert operand, with its spec."""
    return NVFP4Operand(None if op.qdata is None else op.qdata[g],
                        None if op.scale is None else op.scale[g], op.outer_scale[g], op.spec,
                        None if op.values is None else op.values[g])


def check_quantize_args(x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec],
                        signs: Optional[torch.Tensor]) -> None:
    """The checks every backend's :meth:`Backend.quantize_groups` makes (``reference.check_input``
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


def quantize_groups(x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec],
                    col: Optional[QuantSpec], *, seed: IntOrTensor = 0,
                    row_offset: IntOrTensor = 0, col_offset: IntOrTensor = 0,
                    signs: Optional[torch.Tensor] = None,
                    ) -> Tuple[Optional[GroupedOperand], Optional[GroupedOperand]]:
    """The reference :meth:`Backend.quantize_groups` (codes): ``reference.quantize`` on each
    group, ``x[s:e]`` with counter base ``row_offset + s * K / 16`` and ``x[s:e].t()`` with
    ``col_offset + s * K / 16``. One host sync (the bounds).

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
    return rows, cols


def quantize_experts(w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                     ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
    """The reference :meth:`Backend.quantize_experts` (codes): each W_g quantized alone, and
    with ``need_t`` each W_g^T (2d: the exact transpose; 1d: W_g^T quantized along N).

    Raises:
        ValueError: see :func:`check_experts`.
    """
    check_experts(w, spec)
    n_groups, n, k = w.shape
    ws, wts = [], []
    for g in range(n_groups):
        wq = R.quantize(w[g], spec, offset=g * n * k // BLOCK)
        ws.append(wq)
        if need_t:
            wts.append(R.transpose_2d(wq) if spec.block is Block.D2 else
                       R.quantize(w[g].t(), spec, offset=g * n * k // BLOCK))
    return _stack(ws, w.device), (_stack(wts, w.device) if need_t else None)


def grouped_mm(a: GroupedOperand, b: Union[NVFP4Operand, GroupedOperand], *,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference :meth:`Backend.grouped_mm`: ``reference.scaled_mm`` of each group (one host
    sync, the bounds)."""
    bounds = group_bounds(a.offs)
    if isinstance(b, GroupedOperand):
        m, n = a.data.rows, b.data.rows
        out = torch.zeros(a.groups, m, n, dtype=out_dtype, device=a.data.device)
        for g, (s, e) in enumerate(bounds):
            out[g] = R.scaled_mm(group_slice(a, g, s, e), group_slice(b, g, s, e),
                                 out_dtype=out_dtype)
        return out
    out = torch.zeros(a.data.rows, expert_rows(b), dtype=out_dtype, device=a.data.device)
    for g, (s, e) in enumerate(bounds):
        out[s:e] = R.scaled_mm(group_slice(a, g, s, e), expert_slice(b, g), out_dtype=out_dtype)
    return out


def _per_group(x, bounds, spec, transpose, seed, base, signs):
    """``reference.quantize`` of each group's tokens (or their transpose), the group starting at
    row s taking counter base ``base + s * K / 16``."""
    k = x.shape[1]
    return [R.quantize(x[s:e].t() if transpose else x[s:e], spec, seed=seed,
                       offset=base + s * k // BLOCK, rht_signs=signs) for s, e in bounds]


def expert_rows(b: NVFP4Operand) -> int:
    """N of a stacked (G, N, K) expert operand, codes or inner values."""
    return (b.values if b.form is Form.VALUES else b.qdata).shape[1]


def check_experts(w: torch.Tensor, spec: QuantSpec) -> None:
    """The checks of every backend's :meth:`Backend.quantize_experts`.

    Raises:
        ValueError: not (G, N, K); a per-token or RHT spec; shapes ``reference.check_input``
            refuses.
    """
    if w.dim() != 3:
        raise ValueError(f"expert weights must be (G, N, K), got shape {tuple(w.shape)}")
    if spec.per_token or spec.rht:
        raise ValueError(f"expert weights take a per-tensor spec without RHT, got {spec}")
    for g in range(min(1, w.shape[0])):
        R.check_input(w[g], spec)


def _stack(ops, device) -> NVFP4Operand:
    """Per-expert operands (of one spec) stacked along a new first dimension (outer scales (G,))."""
    if not ops:
        raise ValueError("no experts: expert weights need G >= 1")
    return NVFP4Operand(torch.stack([o.qdata for o in ops]), torch.stack([o.scale for o in ops]),
                        torch.stack([o.outer_scale for o in ops]), ops[0].spec)


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
    return GroupedOperand(NVFP4Operand(qdata, scale, outer, spec), offs, False, spec.per_token)


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
    return GroupedOperand(NVFP4Operand(qdata, scale, outer, spec), offs, True, spec.per_token)


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
                        x.new_empty(outer, dtype=torch.float32), spec)
    return GroupedOperand(data, offs, along_k, spec.per_token)


def fake_quantize_groups(backend, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0,
                         signs=None, transient=(False, False), prepare=None):
    """:meth:`Backend.quantize_groups` on fake tensors, for a backend whose body reads the group
    bounds (the copies as codes; ``prepare`` passed through)."""
    return (None if row is None else _fake_groups(x, offs, row, False),
            None if col is None else _fake_groups(x, offs, col, True), prepare)


def fake_grouped_mm(backend, a, b, *, out_dtype=torch.float32):
    """:meth:`Backend.grouped_mm` on fake tensors, for a backend whose body reads the group
    bounds or launches with host-side TMA descriptors."""
    if isinstance(b, GroupedOperand):
        return a.data.outer_scale.new_empty(a.groups, a.data.rows, b.data.rows, dtype=out_dtype)
    return a.data.outer_scale.new_empty(a.data.rows, expert_rows(b), dtype=out_dtype)

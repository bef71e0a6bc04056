"""NVFP4 quantization kernels: the fused 1D rowwise/columnwise kernel and the 2D (16x16) kernel.

Bit-exact with ``nvfp4_recipe.reference.quantize`` (the spec); see ``common`` for how.

``quantize_1d`` reads an (M, K) matrix once and writes, as asked, its rowwise copy (blocks of 16
along K) and its columnwise copy (the quantization of x^T: blocks of 16 along M, optionally through
the 16-point RHT along M), each with RN or SR and a per-tensor or per-token outer scale. The outer
scales need the amax first, so a call is an amax pass (``amax.amax``, one read covering both copies)
then the quantize pass. Seeds and SR offsets may be device scalars (CUDA-graph friendly); nothing
here synchronises with the host.

Each thread owns whole 16 x 16 tiles (``common.load_rows``): the rowwise blocks are its 16 row
blocks, the columnwise blocks its 16 column blocks (``common.transpose16``, register renaming), so
a block's 16 elements always sit in one thread (no shared memory, no layout conversion).

Performance note (docs/benchmarks.md): the fully unrolled per-thread tile makes large kernels
(12k-16k SASS instructions for the pairs) that run far below the copy bandwidth; the numbers, not
the structure, are what a rewrite should keep.
"""

import os
from typing import NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from . import amax as A
from .common import (HUGE_INV, abs_max16_bits, bits16, bits_to_float, block_scale, finish_half,
                     finish_words, load_rows, nibbles, outer_scale, pack16, quantize_block, rht16,
                     scalar_arg, split16, to_f32_again, transpose16)

IntOrTensor = Union[int, torch.Tensor]


class CopySpec(NamedTuple):
    """How one quantized copy is made (the kernel-level twin of ``recipe.OperandSpec`` for 1d).

    sr: stochastic rounding (else RN). rht: 16-point RHT along the copy's blocks first.
    per_token: one outer scale per row of the copy (else per tensor).
    amax_scale: None (measure the amax of what is quantized) or the factor applied to the amax of
        the untransformed input instead (amax estimation, spec item 8).
    """

    sr: bool = False
    rht: bool = False
    per_token: bool = False
    amax_scale: Optional[float] = None


class Quantized(NamedTuple):
    """qdata uint8 (R, C/2); scale float8_e4m3fn (R, C/16) (2d: (R/16, C/16)); outer_scale fp32
    () or (R,). The same layout as ``reference.NVFP4Data``."""

    qdata: torch.Tensor
    scale: torch.Tensor
    outer_scale: torch.Tensor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    """Autotuning space: (BB, BC) = tiles of 16 x 16 per program along M and K (one per thread)."""
    if _interpreting():
        return [triton.Config({"BB": 2, "BC": 2}, num_warps=1)]
    # One-warp programs with the lanes 4 (rows) x 8 (columns): loads, rowwise stores and
    # columnwise stores all keep the register layout (no shared-memory conversion), and each
    # columnwise store writes whole 32-byte sectors (4 consecutive row blocks of 8 columns).
    configs = [triton.Config({"BB": bb, "BC": bc}, num_warps=nw)
               for bb, bc, nw in ((4, 8, 1), (8, 4, 1), (1, 128, 4))]
    return configs[:1] if os.environ.get("NVFP4_AUTOTUNE") == "0" else configs


# ----------------------------------------------------------------------------------------------
# 1D kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _u32(x):
    return tl.cast(x, tl.uint32)


@triton.jit
def _scales(amax_ptr, o_ptr, idx, n, mult, PER_TOKEN: tl.constexpr, MULT: tl.constexpr, write):
    """(s_div, 1 / s_div, huge) of the tensor, or of operand rows ``idx`` (< n; an (X, 1) or
    (1, X) tensor) when PER_TOKEN; writes s_outer where ``write``. huge: a scalar, whether some
    1 / s_div >= 2**122 (see quantize_block)."""
    if PER_TOKEN:
        s_outer, s_div, inv_div = outer_scale(tl.load(amax_ptr + idx, mask=idx < n, other=0.0), mult, MULT)
        if write:
            tl.store(o_ptr + idx, s_outer, mask=idx < n)
        huge = tl.max(tl.max(inv_div, axis=1), axis=0) >= HUGE_INV
    else:
        s_outer, s_div, inv_div = outer_scale(tl.load(amax_ptr), mult, MULT)
        if write:
            tl.store(o_ptr, s_outer)
        huge = inv_div >= HUGE_INV
    return s_div, inv_div, huge


@triton.jit
def _quantize_store(y, row, blk, n_rows, n_cols, q_ptr, s_ptr, s_div, inv_div, huge, seed,
                    offset, mul16, SR: tl.constexpr, CLAMP: tl.constexpr):
    """Quantize fp32 (BB, BC, 16) blocks of operand rows ``row`` and block columns ``blk``
    (index tensors broadcasting to (BB, BC)) of an (n_rows, n_cols) operand; store the codes at
    q_ptr (int64 view of the (n_rows, n_cols / 2) bytes) and the scales at s_ptr."""
    counter = _u32(offset) + _u32(row) * _u32(n_cols // 8) + _u32(blk) * 2
    words, scode = quantize_block(y, s_div, inv_div, huge, seed, counter, mul16, SR, CLAMP)
    idx = row * (n_cols // 16) + blk
    mask = (row < n_rows) & (blk < n_cols // 16)
    tl.store(q_ptr + idx, words.to(tl.int64, bitcast=True), mask=mask)
    tl.store(s_ptr + idx, scode.to(tl.uint8), mask=mask)


@triton.autotune(configs=_configs(),
                 key=["M", "K", "ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_MULT", "COL", "COL_RHT",
                      "COL_SR", "COL_PER_TOKEN", "COL_MULT"])
@triton.jit
def _quantize_1d_kernel(x_ptr, M, K, stride_m, stride_k, signs_ptr, seed_arg, mul16,
                        rq_ptr, rs_ptr, ro_ptr, ramax_ptr, r_mult, roff_arg,
                        cq_ptr, cs_ptr, co_ptr, camax_ptr, c_mult, coff_arg,
                        ROW: tl.constexpr, ROW_SR: tl.constexpr, ROW_PER_TOKEN: tl.constexpr,
                        ROW_MULT: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                        COL_SR: tl.constexpr, COL_PER_TOKEN: tl.constexpr, COL_MULT: tl.constexpr,
                        SEED_PTR: tl.constexpr, ROFF_PTR: tl.constexpr, COFF_PTR: tl.constexpr,
                        BB: tl.constexpr, BC: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_b * BB + tl.arange(0, BB)
    c = pid_c * BC + tl.arange(0, BC)
    rows = load_rows(x_ptr, b, c, M, K, stride_m, stride_k)  # rows[j][b, c, i] = x[16b + j, 16c + i]
    seed = scalar_arg(seed_arg, SEED_PTR)
    first = (pid_b == 0) & (pid_c == 0)
    if ROW:  # operand x (M, K): rows m = 16b + j, block columns c
        offset = scalar_arg(roff_arg, ROFF_PTR)
        if not ROW_PER_TOKEN:
            s_div, inv_div, huge = _scales(ramax_ptr, ro_ptr, 0, 1, r_mult, False, ROW_MULT, first)
        for j in tl.static_range(16):
            m = (b * 16 + j)[:, None]
            if ROW_PER_TOKEN:
                s_div, inv_div, huge = _scales(ramax_ptr, ro_ptr, m, M, r_mult, True, ROW_MULT, pid_c == 0)
            _quantize_store(rows[j].to(tl.float32), m, c[None, :], M, K, rq_ptr, rs_ptr, s_div,
                            inv_div, huge, seed, offset, mul16, ROW_SR, ROW_MULT)
    if COL:  # operand x^T (K, M): rows k = 16c + i, block columns b
        offset = scalar_arg(coff_arg, COFF_PTR)
        cols = transpose16(rows)  # cols[i][b, c, j] = x[16b + j, 16c + i]
        if not COL_PER_TOKEN:
            s_div, inv_div, huge = _scales(camax_ptr, co_ptr, 0, 1, c_mult, False, COL_MULT, first)
        if COL_RHT:
            signs = tl.load(signs_ptr + tl.arange(0, 16))
        for i in tl.static_range(16):
            k = (c * 16 + i)[None, :]
            if COL_PER_TOKEN:
                s_div, inv_div, huge = _scales(camax_ptr, co_ptr, k, K, c_mult, True, COL_MULT, pid_b == 0)
            y = to_f32_again(cols[i])
            if COL_RHT:
                y = rht16(y, signs)
            _quantize_store(y, k, b[:, None], K, M, cq_ptr, cs_ptr, s_div, inv_div, huge, seed,
                            offset, mul16, COL_SR, COL_MULT)


# ----------------------------------------------------------------------------------------------
# 2D kernel
# ----------------------------------------------------------------------------------------------
@triton.autotune(configs=_configs(), key=["N", "K", "W", "WT", "SR", "MULT"])
@triton.jit
def _quantize_2d_kernel(w_ptr, N, K, stride_n, stride_k, amax_ptr, mult, seed_arg, off_arg, mul16,
                        q_ptr, s_ptr, qt_ptr, st_ptr, o_ptr,
                        W: tl.constexpr, WT: tl.constexpr, SR: tl.constexpr, MULT: tl.constexpr,
                        SEED_PTR: tl.constexpr, OFF_PTR: tl.constexpr,
                        BB: tl.constexpr, BC: tl.constexpr):
    """W (N, K) in 16x16 blocks: codes stored packed along the rows (q_ptr: int64 view of W's
    (N, K/2) bytes) and along the columns (qt_ptr: int32 view of W^T's (K, N/2) bytes), each code
    computed once. Rows are taken last to first so that the W^T words build up by base-16 Horner
    steps on in-register (BB, BC, 16) accumulators; their halves are stored as they complete."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_b * BB + tl.arange(0, BB)
    c = pid_c * BC + tl.arange(0, BC)
    rows = load_rows(w_ptr, b, c, N, K, stride_n, stride_k)  # rows[j][b, c, i] = w[16b + j, 16c + i]
    s_outer, s_div, inv_div = outer_scale(tl.load(amax_ptr), mult, MULT)
    if (pid_b == 0) & (pid_c == 0):
        tl.store(o_ptr, s_outer)
    a = abs_max16_bits(rows[0])  # the tile amax, on the input's bit patterns
    for j in tl.static_range(1, 16):
        a = tl.maximum(a, abs_max16_bits(rows[j]))
    scode, recip = block_scale(bits_to_float(a, rows[0].dtype), s_div, inv_div)
    bad = recip != recip
    huge = inv_div >= HUGE_INV
    mask = (b < N // 16)[:, None] & (c < K // 16)[None, :]
    if W:
        tl.store(s_ptr + b[:, None] * (K // 16) + c[None, :], scode.to(tl.uint8), mask=mask)
    if WT:
        tl.store(st_ptr + c[None, :] * (N // 16) + b[:, None], scode.to(tl.uint8), mask=mask)
    seed = scalar_arg(seed_arg, SEED_PTR)
    counter = (_u32(scalar_arg(off_arg, OFF_PTR)) + _u32(b[:, None] * 16) * _u32(K // 8)
               + _u32(c[None, :]) * 2)  # of element (0, 0) of each tile, W's row-major order
    for j in tl.static_range(15, -1, -1):
        bits = 0
        if SR:
            bits = bits16(seed, counter + _u32(j) * _u32(K // 8))
        cj, sj = nibbles(rows[j].to(tl.float32) * recip[:, :, None], bits, huge,
                         (mul16 // 8).to(tl.uint32), SR, MULT)
        if W:
            n = (b * 16 + j)[:, None]
            word = finish_words(pack16(cj, mul16), pack16(sj, mul16), bad[:, :, None], SR)
            tl.store(q_ptr + n * (K // 16) + c[None, :], word.to(tl.int64, bitcast=True), mask=mask)
        if WT:
            if j % 8 == 7:
                col_c = cj
                col_s = sj
            else:
                col_c = col_c * mul16 + cj
                col_s = col_s * mul16 + sj
            if j % 8 == 0:  # the words of rows j..j+7 of every column: W^T half-word j // 8
                half = split16(finish_half(col_c, col_s, bad[:, :, None], SR))
                for i in tl.static_range(16):
                    k = (c * 16 + i)[None, :]
                    tl.store(qt_ptr + (k * (N // 16) + b[:, None]) * 2 + j // 8,
                             half[i].to(tl.int32, bitcast=True), mask=mask)


# ----------------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------------
def _scalar(v: IntOrTensor, device) -> Tuple[Union[int, torch.Tensor], bool]:
    """A seed/offset as a kernel argument: an int by value, a tensor as a device pointer."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype.is_floating_point:
            raise TypeError(f"seeds and offsets must be ints or one-element integer tensors, got {v}")
        return v.to(device=device, dtype=torch.int64, non_blocking=True).reshape(()), True
    return int(v), False


def _outputs(rows: int, cols: int, n_outer: int, device) -> Quantized:
    outer = torch.empty((n_outer,) if n_outer else (), dtype=torch.float32, device=device)
    return Quantized(torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),
                     torch.empty(rows, cols // 16, dtype=torch.uint8, device=device), outer)


def _as_e4m3(q: Quantized) -> Quantized:
    return q._replace(scale=q.scale.view(torch.float8_e4m3fn))


def quantize_1d(x: torch.Tensor, row: Optional[CopySpec] = None, col: Optional[CopySpec] = None,
                *, seed: IntOrTensor = 0, row_offset: IntOrTensor = 0, col_offset: IntOrTensor = 0,
                signs: Optional[torch.Tensor] = None,
                amaxes: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                ) -> Tuple[Optional[Quantized], Optional[Quantized]]:
    """Rowwise and/or columnwise 1D NVFP4 quantization of a matrix from one read (plus the amax pass).

    Args:
        x: (M, K) bfloat16/float16/float32, any strides (a transposed view reads coalesced through
            its columnwise path, see the backend). K must be a multiple of 16; M too for ``col``.
        row: the rowwise copy, blocks along K (``reference.quantize(x, ...)``), or None.
        col: the columnwise copy, the quantization of x^T with blocks along M
            (``reference.quantize(x.t(), ...)``), or None.
        seed, row_offset, col_offset: Philox stream of the SR copies (ints or device int64 scalars).
        signs: (16,) +-1 RHT signs (any device; needed when a copy has ``rht``).
        amaxes: the (row, column) fp32 amaxes as :func:`amax_pass` returns them for these specs, to
            skip the amax pass (benchmarks time the two passes apart).
    Returns:
        (rowwise, columnwise) :class:`Quantized` or None each: qdata (M, K/2) / (K, M/2) uint8,
        scale (M, K/16) / (K, M/16) float8_e4m3fn, outer scale () or (M,) / (K,) fp32.
    Raises:
        TypeError: unsupported dtype. ValueError: shape, or an RHT without signs.
    Source: spec items 1-10 of docs/numerics.md (reference.py).
    """
    A.check_matrix(x, rows16=col is not None, cols16=row is not None)
    if row is not None and row.rht:
        # RHT along K = the columnwise path of x^T (a strided view; slower loads, same bits)
        return (quantize_1d(x.t(), col=row, seed=seed, col_offset=row_offset, signs=signs)[1],
                quantize_1d(x, col=col, seed=seed, col_offset=col_offset, signs=signs)[1]
                if col is not None else None)
    if (row and row.rht or col and col.rht) and signs is None:
        raise ValueError("an RHT copy needs the 16 RHT signs")
    m, k = x.shape
    dev = x.device
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if col and col.rht else x
    row_amax, col_amax = amaxes if amaxes is not None else amax_pass(x, row, col, signs_t)
    r = _outputs(m, k, m if row and row.per_token else 0, dev) if row else None
    c = _outputs(k, m, k if col and col.per_token else 0, dev) if col else None
    seed_a, seed_p = _scalar(seed, dev)
    roff_a, roff_p = _scalar(row_offset, dev)
    coff_a, coff_p = _scalar(col_offset, dev)
    dummy = x
    grid = lambda meta: (triton.cdiv(m, 16 * meta["BB"]), triton.cdiv(k, 16 * meta["BC"]))
    _quantize_1d_kernel[grid](
        x, m, k, x.stride(0), x.stride(1), signs_t, seed_a, 16,
        r.qdata.view(torch.int64) if r else dummy, r.scale if r else dummy,
        r.outer_scale if r else dummy, row_amax if r else dummy,
        float(row.amax_scale or 1.0) if r else 1.0, roff_a,
        c.qdata.view(torch.int64) if c else dummy, c.scale if c else dummy,
        c.outer_scale if c else dummy, col_amax if c else dummy,
        float(col.amax_scale or 1.0) if c else 1.0, coff_a,
        ROW=r is not None, ROW_SR=bool(row and row.sr), ROW_PER_TOKEN=bool(row and row.per_token),
        ROW_MULT=bool(row and row.amax_scale is not None),
        COL=c is not None, COL_RHT=bool(col and col.rht), COL_SR=bool(col and col.sr),
        COL_PER_TOKEN=bool(col and col.per_token), COL_MULT=bool(col and col.amax_scale is not None),
        SEED_PTR=seed_p, ROFF_PTR=roff_p, COFF_PTR=coff_p)
    return (_as_e4m3(r) if r else None, _as_e4m3(c) if c else None)


def amax_pass(x: torch.Tensor, row: Optional[CopySpec], col: Optional[CopySpec],
              signs: Optional[torch.Tensor] = None):
    """The amaxes (before any amax_scale factor) that :func:`quantize_1d` needs for copies ``row``
    and ``col`` of x, from one pass over x: (row amax or None, column amax or None), fp32 device
    tensors, () or per index. The column amax is of the RHT output when ``col.rht`` and no
    amax_scale (estimation skips that pass)."""
    def mode(spec):
        if spec is None:
            return A.NONE
        return A.PER_INDEX if spec.per_token else A.TENSOR
    r_mode, c_mode = mode(row), mode(col)
    col_rht = bool(col and col.rht and col.amax_scale is None)
    if c_mode == A.TENSOR and not col_rht and r_mode != A.PER_INDEX:
        a, _ = A.amax(x, A.TENSOR, A.NONE)  # one global amax serves both copies
        return (a if row else None), a
    return A.amax(x, r_mode, c_mode, col_rht, signs if col_rht else None)


def quantize_2d(w: torch.Tensor, *, sr: bool = False, seed: IntOrTensor = 0,
                offset: IntOrTensor = 0, amax_scale: Optional[float] = None,
                write_w: bool = True, write_wt: bool = True, amax: Optional[torch.Tensor] = None,
                ) -> Tuple[Optional[Quantized], Optional[Quantized]]:
    """2D (16x16 block) NVFP4 quantization of a matrix and its exact transpose from one read.

    Args:
        w: (N, K) bfloat16/float16/float32, any strides, both dimensions multiples of 16.
        sr, seed, offset: stochastic rounding and its Philox stream (index order of W, row-major).
        amax_scale: None (measure amax(w)) or a factor applied to it (spec item 8).
        write_w, write_wt: which of W and W^T to write.
        amax: max |w| (fp32 device scalar) to skip the amax pass.
    Returns:
        (W, W^T) :class:`Quantized` or None: qdata (N, K/2) / (K, N/2), scale (N/16, K/16) /
        (K/16, N/16), shared per-tensor outer scale; W^T equals ``reference.transpose_2d(W)``.
    Raises:
        TypeError: unsupported dtype. ValueError: shape.
    Source: spec items 1-6 with 2d blocks (reference.quantize(block="2d")).
    """
    A.check_matrix(w, rows16=True, cols16=True)
    n, k = w.shape
    dev = w.device
    amax_ = amax if amax is not None else A.amax(w, A.TENSOR, A.NONE)[0]
    outer = torch.empty((), dtype=torch.float32, device=dev)
    q = torch.empty(n, k // 2, dtype=torch.uint8, device=dev) if write_w else None
    s = torch.empty(n // 16, k // 16, dtype=torch.uint8, device=dev) if write_w else None
    qt = torch.empty(k, n // 2, dtype=torch.uint8, device=dev) if write_wt else None
    st = torch.empty(k // 16, n // 16, dtype=torch.uint8, device=dev) if write_wt else None
    seed_a, seed_p = _scalar(seed, dev)
    off_a, off_p = _scalar(offset, dev)
    grid = lambda meta: (triton.cdiv(n, 16 * meta["BB"]), triton.cdiv(k, 16 * meta["BC"]))
    _quantize_2d_kernel[grid](
        w, n, k, w.stride(0), w.stride(1), amax_, float(amax_scale or 1.0), seed_a, off_a, 16,
        q.view(torch.int64) if write_w else w, s if write_w else w,
        qt.view(torch.int32) if write_wt else w, st if write_wt else w, outer,
        W=write_w, WT=write_wt, SR=sr, MULT=amax_scale is not None, SEED_PTR=seed_p, OFF_PTR=off_p)
    wq = Quantized(q, s.view(torch.float8_e4m3fn), outer) if write_w else None
    wtq = Quantized(qt, st.view(torch.float8_e4m3fn), outer) if write_wt else None
    return wq, wtq

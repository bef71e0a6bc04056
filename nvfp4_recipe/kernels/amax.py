"""Amax kernels: max |x| over a tensor, per row, per column, and of the RHT output along either.

One kernel reads a tile of x as column blocks (16 rows of one column in a thread's registers, the
blocks of the columnwise copy; ``tiles.load_col_blocks``) and reduces it to any of: the global
amax, per-row amaxes (per-token scaling of the rowwise copy), and the global or per-column amax of
x or of the 16-point RHT of x along M (the columnwise copy), the last without writing the
transformed tensor. The grid is persistent (a few programs per SM, each looping over tiles): a
program folds its tiles' per-tensor maxima in registers and issues one atomic max per result at the
end (per-index maxima: one per element and tile), which measured faster than one program a tile
with its own atomics. The RHT maxima fold the last butterfly stage into the maximum
(``hadamard.hadamard16_abs_max``); a program whose result is Inf or NaN takes its tiles again with
the full transform, which alone gives NaN where two Infs meet. The maxima are taken on the int32
bit patterns of |x|, so NaN wins over everything and propagates (spec item 9).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..spec import QuantSpec
from .hadamard import hadamard16, hadamard16_abs_max
from .rounding import abs_bits, round_to
from .runtime import Launcher, autotune, cdiv, interpreting, num_sms, prune_wide_tiles
from .tiles import abs_max16, abs_max16_bits, bits_to_float, load_col_blocks, load_row_blocks

# What an amax output holds: the ``row`` / ``col`` modes of :func:`amax` and
# ``grouped_amax.grouped_amax_pass``, and the ROW / COL constexprs of their kernels: nothing; one
# amax per tensor (in the grouped kernels one per group: a group's tokens are its tensor); one per
# index (per row or per column: per-token scaling).
NONE, TENSOR, PER_INDEX = 0, 1, 2
# The same modes for @triton.jit code, which reads only tl.constexpr globals.
JIT_NONE, JIT_TENSOR, JIT_PER_INDEX = (tl.constexpr(NONE), tl.constexpr(TENSOR),
                                        tl.constexpr(PER_INDEX))


def amax_mode(spec: Optional[QuantSpec]) -> int:
    """The amax a copy quantized under ``spec`` needs: NONE for no copy (None), PER_INDEX for
    per-token scaling, else TENSOR."""
    if spec is None:
        return NONE
    return PER_INDEX if spec.per_token else TENSOR


def amax_slots(mode: int, n_index: int, n_tensors: int = 1) -> int:
    """Values an amax output of ``mode`` holds: none, one per tensor (``n_tensors``: the groups of
    a grouped pass), or ``n_index``."""
    return 0 if mode == NONE else n_tensors if mode == TENSOR else n_index


def amax_configs():
    """(BB, BC) = a tile in 16 x 16 blocks, P = programs per SM of the persistent grid. The first
    measured fastest for the global + RHT amax at the 16384 x 4096 and 32768 x 2048 benchmark shapes
    on an H200 and is the only one without NVFP4_AUTOTUNE=1 (:func:`_lead` puts another first for
    per-index maxima); narrower tiles for small K (see ``runtime.prune_wide_tiles``). The grouped
    amax kernel takes the same space."""
    if interpreting():
        return [triton.Config({"BB": 2, "BC": 2, "P": 1}, num_warps=1)]
    space = ((2, 16, 4, 4), (2, 16, 16, 4), (2, 8, 8, 4), (4, 4, 8, 4), (8, 4, 8, 4))
    return [triton.Config({"BB": bb, "BC": bc, "P": p}, num_warps=nw) for bb, bc, p, nw in space]


def _lead(config, args) -> bool:
    """Whether ``config`` goes first for a launch with ``args``: for per-row or per-column maxima
    (per-token scaling; one atomic per index and tile), the tiles of 128 rows x 64 columns, whose
    column atomics are a quarter of those of the first config's 32 x 256 tiles (rows: four
    times). Per-token amaxes of X and X^T, bf16 on an H200 (``benchmarks/sweep_quantize.py``):
    16384 x 4096 50 against 67 us, 32768 x 512 19 against 36 us; with the RHT amax of X^T 81
    against 112 us and 28 against 41 us."""
    per_index = PER_INDEX in (args["ROW"], args["COL"]) and not args["ROW_RHT"]
    return per_index and (config.kwargs["BB"], config.kwargs["BC"]) == (8, 4)


@triton.jit
def block_max_bits(t):
    """max |t| over the last axis of (A, B, 16) blocks, as the int32 bits of the fp32 value."""
    return abs_bits(bits_to_float(abs_max16_bits(t), t.dtype))


@triton.jit
def rht_block_max_bits(y, signs, dtype: tl.constexpr, EXACT: tl.constexpr):
    """max |RHT| of (A, B, 16) fp32 blocks ``y`` along their last axis, of the transform's
    values as the RHT operand has them (x / 4 rounded to ``dtype``, item 7), as int32 bits of
    the fp32 value. Rounding is monotone and odd, so the rounded max is the max rounded. Without
    EXACT the last butterfly stage is folded into the maximum (``hadamard16_abs_max``), which
    gives Inf where Inf - Inf is NaN: a result of Inf or NaN must be taken again with EXACT."""
    if EXACT:
        h = abs_max16(hadamard16(y, signs))
    else:
        h = hadamard16_abs_max(y, signs)
    return abs_bits(round_to(h * 0.25, dtype))


@triton.jit
def _amax_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr, col_ptr, ROW: tl.constexpr,
                COL: tl.constexpr, COL_RHT: tl.constexpr, EXACT: tl.constexpr, BB: tl.constexpr,
                BC: tl.constexpr):
    """This program's tiles (every num_programs-th of 16 BB rows x 16 BC columns, column tiles of
    a row band in turn), read as column blocks (the columnwise copy's blocks: 16 rows of one
    column in a thread's registers), which serve every output: the RHT runs along their register
    axis, and the row maxima reduce across columns. Per-index maxima go out with one atomic per
    element and tile; returns the per-tensor maxima folded in registers (row, column), (16 BC, BB)
    int32 bits. Without EXACT the RHT maxima come from :func:`hadamard16_abs_max`."""
    n_k = tl.cdiv(K, 16 * BC)
    row_acc = tl.zeros((16 * BC, BB), dtype=tl.int32)
    col_acc = tl.zeros((16 * BC, BB), dtype=tl.int32)
    for tile in range(tl.program_id(0), tl.cdiv(M, 16 * BB) * n_k, tl.num_programs(0)):
        k = (tile % n_k) * (16 * BC) + tl.arange(0, 16 * BC)
        b = (tile // n_k) * BB + tl.arange(0, BB)
        t = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)  # t[a, d, j] = x[16 b[d] + j, k[a]]
        if COL_RHT:  # one fp32 copy serves both maxima
            y = t.to(tl.float32)
            tile_max = abs_bits(abs_max16(y))
            col_max = rht_block_max_bits(y, signs, t.dtype, EXACT)
        else:
            tile_max = block_max_bits(t)
            col_max = tile_max
        if ROW == JIT_TENSOR:
            row_acc = tl.maximum(row_acc, tile_max)
        if ROW == JIT_PER_INDEX:
            m = b[:, None] * 16 + tl.arange(0, 16)[None, :]
            tl.atomic_max(row_ptr + m, tl.max(abs_bits(t.to(tl.float32)), axis=0), mask=m < M)
        if COL == JIT_PER_INDEX:
            tl.atomic_max(col_ptr + k, tl.max(col_max, axis=1), mask=k < K)
        col_acc = tl.maximum(col_acc, col_max)
    return row_acc, col_acc


@triton.jit
def _row_rht_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr, PER_ROW: tl.constexpr,
                   EXACT: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """The maxima of the RHT along K over this program's tiles (those of :func:`_amax_tiles`),
    read as row blocks (16 elements of a row in a thread's registers, where the transform runs).
    Per-row maxima (PER_ROW) go out with one atomic per row and tile; returns the per-tensor
    maxima folded in registers, (16 BB, BC) int32 bits."""
    n_k = tl.cdiv(K, 16 * BC)
    acc = tl.zeros((16 * BB, BC), dtype=tl.int32)
    for tile in range(tl.program_id(0), tl.cdiv(M, 16 * BB) * n_k, tl.num_programs(0)):
        m = (tile // n_k) * (16 * BB) + tl.arange(0, 16 * BB)
        c = (tile % n_k) * BC + tl.arange(0, BC)
        t = load_row_blocks(x_ptr, m, c, M, K, stride_m, stride_k)  # t[a, b, i] = x[m[a], 16 c[b] + i]
        row_max = rht_block_max_bits(t.to(tl.float32), signs, t.dtype, EXACT)
        if PER_ROW:
            tl.atomic_max(row_ptr + m, tl.max(row_max, axis=1), mask=m < M)
        acc = tl.maximum(acc, row_max)
    return acc


@triton.jit
def _fold(acc):
    return tl.max(tl.max(acc, axis=1), axis=0)


@autotune(configs=amax_configs(), key=["M", "K", "ROW", "COL", "COL_RHT", "ROW_RHT"],
          prune=prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], _lead))
@triton.jit
def _amax_kernel(x_ptr, M, K, stride_m, stride_k, signs_ptr, out_ptr, col_off,
                 ROW: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                 ROW_RHT: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, P: tl.constexpr):
    """A persistent grid over :func:`_amax_tiles` (or, with ROW_RHT, :func:`_row_rht_tiles`, the
    row maxima of the RHT along K, no column maxima); per-tensor maxima go out once per program
    at the end. The fp32 output holds the row maxima from ``out_ptr`` and the column maxima from
    ``out_ptr + col_off``, taken as int32 bits (atomic max on the bits). A program whose RHT
    maxima reached Inf or NaN (where the folded last butterfly stage can miss an Inf - Inf) takes
    its tiles again with the full transform."""
    row_ptr = out_ptr.to(tl.pointer_type(tl.int32))
    col_ptr = row_ptr + col_off
    signs = tl.load(signs_ptr + tl.arange(0, 16)) if COL_RHT or ROW_RHT else None
    if ROW_RHT:
        row = _fold(_row_rht_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr,
                                   ROW == JIT_PER_INDEX, False, BB, BC))
        if row >= 0x7F800000:  # the bits of +Inf; NaNs above
            row = _fold(_row_rht_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr,
                                       ROW == JIT_PER_INDEX, True, BB, BC))
        if ROW == JIT_TENSOR:
            tl.atomic_max(row_ptr, row)
    else:
        row_acc, col_acc = _amax_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr, col_ptr,
                                       ROW, COL, COL_RHT, False, BB, BC)
        col = _fold(col_acc)
        if COL_RHT:
            if col >= 0x7F800000:  # the bits of +Inf; NaNs above
                _, col_acc = _amax_tiles(x_ptr, M, K, stride_m, stride_k, signs, row_ptr, col_ptr,
                                         JIT_NONE, COL, COL_RHT, True, BB, BC)
                col = _fold(col_acc)
        if ROW == JIT_TENSOR:
            tl.atomic_max(row_ptr, _fold(row_acc))
        if COL == JIT_TENSOR:
            tl.atomic_max(col_ptr, col)


_AMAX = Launcher(_amax_kernel)


def check_matrix(x: torch.Tensor, rows16: bool, cols16: bool) -> None:
    """Raise TypeError/ValueError unless x is a 2-D bf16/fp16/fp32 matrix whose first (rows16) and
    last (cols16) dimensions are multiples of 16 as asked (the dimensions blocks run along)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"NVFP4 kernels take bfloat16, float16 or float32 input, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    for dim, (size, needed) in enumerate(zip(x.shape, (rows16, cols16))):
        if needed and size % 16:
            raise ValueError(f"dimension {dim} must be a multiple of 16 (NVFP4 blocks run along it), "
                             f"got shape {tuple(x.shape)}")


def amax(x: torch.Tensor, row: int = TENSOR, col: int = NONE, col_rht: bool = False,
         signs: Optional[torch.Tensor] = None, row_rht: bool = False,
         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Amaxes of a matrix in one read, as fp32 device tensors (no host synchronisation).

    Args:
        x: (M, K) bfloat16/float16/float32 matrix, any strides; M a multiple of 16 with
            ``col_rht`` (the transform runs on blocks of 16 rows).
        row: NONE, TENSOR (max |x|, shape ()) or PER_INDEX (max over each row, shape (M,)).
        col: NONE, TENSOR or PER_INDEX (max over each column, shape (K,)), of x or, with
            ``col_rht``, of the 16-point RHT of x along M rounded to x's dtype
            (``reference.rht(x.t(), signs)``).
        signs: (16,) fp32 +-1 RHT signs on x's device (needed with ``col_rht`` or ``row_rht``).
        row_rht: the row amax is of the 16-point RHT of x along K rounded to x's dtype
            (``reference.rht(x, signs)``; K a multiple of 16); then ``col`` must be NONE.
    Returns:
        (row amax or None, column amax or None).
    Raises:
        TypeError: unsupported dtype. ValueError: shape not as above, an RHT without signs, or
            row_rht with a column amax.
    """
    check_matrix(x, rows16=col_rht, cols16=row_rht)
    if (col_rht or row_rht) and signs is None:
        raise ValueError("the RHT amax needs the 16 RHT signs")
    if row_rht and col != NONE:
        raise ValueError("the amax of the RHT along K reads row blocks: no column amax with it")
    m, k = x.shape
    n_row, n_col = amax_slots(row, m), amax_slots(col, k)
    if not (row or col):
        return None, None
    if row and col:  # one zeroed buffer (one fill), split after the launch
        out = torch.zeros(n_row + n_col, dtype=torch.float32, device=x.device)
    else:  # the one output, its own shape
        out = torch.zeros((n_row or n_col,) if PER_INDEX in (row, col) else (),
                          dtype=torch.float32, device=x.device)
    sms = num_sms(x.device)
    grid = lambda meta: (min(cdiv(m, 16 * meta["BB"]) * cdiv(k, 16 * meta["BC"]), sms * meta["P"]),)
    _AMAX[grid](x, m, k, x.stride(0), x.stride(1), signs if col_rht or row_rht else out, out,
                n_row, ROW=row, COL=col, COL_RHT=col_rht, ROW_RHT=row_rht)
    if not (row and col):
        return (out, None) if row else (None, out)
    return _part(out, 0, n_row, row), _part(out, n_row, n_col, col)


def _part(out: torch.Tensor, start: int, size: int, mode: int) -> torch.Tensor:
    """One output's view of the shared buffer: a 0-d tensor for TENSOR, else ``size`` values."""
    return out[start] if mode == TENSOR else out[start:start + size]

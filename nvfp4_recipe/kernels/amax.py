"""Amax kernels: max |x| over a tensor, per row, per column, and of the columnwise RHT output.

One kernel reads a tile of rows 16b + j (tuple form, see ``common``) and reduces it to any of:
the global amax, per-row amaxes (per-token scaling of the rowwise copy), and the global or
per-column amax of x or of the 16-point RHT of x along M (the columnwise copy, blocks along M),
the last without writing the transformed tensor. Each program folds its tile into the results with
one atomic max per output element it touches (one in all for a global amax). The maxima are taken
on the int32 bit patterns of |x|, so NaN wins over everything and propagates (spec item 9).
"""

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .common import abs_bits, load_rows, prune_wide_tiles, rht16, to_f32_again, transpose16

NONE, TENSOR, PER_INDEX = 0, 1, 2  # what an amax output holds


def _configs():
    """(BB, BC) = a program's tile in 16 x 16 blocks (one per thread); narrower tiles for small K
    (see ``prune_wide_tiles``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BB": 2, "BC": 2}, num_warps=1)]
    space = ((1, 128, 4), (2, 64, 4), (4, 32, 4), (8, 16, 4), (4, 8, 1))
    return [triton.Config({"BB": bb, "BC": bc}, num_warps=nw) for bb, bc, nw in space]


@triton.jit
def _abs_max_bits(y):
    """max |y| over the last axis of (A, B, 16) fp32, as int32 bits (exact, NaN above Inf)."""
    return tl.max(abs_bits(y), axis=2)


@triton.autotune(configs=_configs(), key=["M", "K", "ROW", "COL", "COL_RHT"],
                 prune_configs_by={"early_config_prune": prune_wide_tiles(lambda c: 16 * c.kwargs["BC"])})
@triton.jit
def _amax_kernel(x_ptr, M, K, stride_m, stride_k, signs_ptr, row_ptr, col_ptr,
                 ROW: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                 BB: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rows = load_rows(x_ptr, b, c, M, K, stride_m, stride_k)  # rows[j][b, c, i] = x[16b + j, 16c + i]
    if ROW == 1:
        a = _abs_max_bits(rows[0].to(tl.float32))
        for j in tl.static_range(1, 16):
            a = tl.maximum(a, _abs_max_bits(rows[j].to(tl.float32)))
        tl.atomic_max(row_ptr, tl.max(tl.max(a, axis=1), axis=0))
    if ROW == 2:
        for j in tl.static_range(16):
            m = b * 16 + j
            tl.atomic_max(row_ptr + m, tl.max(_abs_max_bits(rows[j].to(tl.float32)), axis=1), mask=m < M)
    if COL != 0:
        cols = transpose16(rows)  # cols[i][b, c, j] = x[16b + j, 16c + i]
        if COL_RHT:
            signs = tl.load(signs_ptr + tl.arange(0, 16))
        for i in tl.static_range(16):
            y = to_f32_again(cols[i])
            if COL_RHT:
                y = rht16(y, signs)
            a = _abs_max_bits(y)  # (BB, BC): per column 16c + i and row block b
            if COL == 1:
                col_max = a if i == 0 else tl.maximum(col_max, a)
            else:
                k = c * 16 + i
                tl.atomic_max(col_ptr + k, tl.max(a, axis=0), mask=k < K)
        if COL == 1:
            tl.atomic_max(col_ptr, tl.max(tl.max(col_max, axis=1), axis=0))


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
         signs: Optional[torch.Tensor] = None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Amaxes of a matrix in one read, as fp32 device tensors (no host synchronisation).

    Args:
        x: (M, K) bfloat16/float16/float32 matrix, any strides; M a multiple of 16 with
            ``col_rht`` (the transform runs on blocks of 16 rows).
        row: NONE, TENSOR (max |x|, shape ()) or PER_INDEX (max over each row, shape (M,)).
        col: NONE, TENSOR or PER_INDEX (max over each column, shape (K,)), of x or, with
            ``col_rht``, of the 16-point RHT of x along M (``reference.rht(x.t(), signs)``).
        signs: (16,) fp32 +-1 RHT signs on x's device (needed with ``col_rht``).
    Returns:
        (row amax or None, column amax or None).
    Raises:
        TypeError: unsupported dtype. ValueError: shape not as above, or col_rht without signs.
    """
    check_matrix(x, rows16=col_rht, cols16=False)
    if col_rht and signs is None:
        raise ValueError("the RHT amax needs the 16 RHT signs")
    m, k = x.shape
    sizes = {NONE: 0, TENSOR: 1}
    n_row, n_col = sizes.get(row, m), sizes.get(col, k)
    buf = torch.zeros(n_row + n_col, dtype=torch.int32, device=x.device)
    row_buf, col_buf = buf[:n_row], buf[n_row:]
    signs = signs if col_rht else buf
    grid = lambda meta: (triton.cdiv(m, 16 * meta["BB"]), triton.cdiv(k, 16 * meta["BC"]))
    _amax_kernel[grid](x, m, k, x.stride(0), x.stride(1), signs, row_buf, col_buf,
                       ROW=row, COL=col, COL_RHT=col_rht)
    as_float = lambda b, mode: b.view(torch.float32).reshape(()) if mode == TENSOR else b.view(torch.float32)
    return (as_float(row_buf, row) if row else None, as_float(col_buf, col) if col else None)

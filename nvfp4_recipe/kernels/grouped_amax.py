"""The amax pass of the grouped quantization (``grouped_quantize.quantize_grouped``): per group,
or per token, the maxima of |x| that the copies of token groups (``groups``) need, from one read.

Group g's amaxes equal those ``amax.amax`` takes of that group alone: its per-tensor amax, per-row
amaxes, or the per-column amaxes of x_g or of its RHT along the tokens (x_g^T's blocks); groups
without tokens have amax 0, rows past the last group are not read.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..spec import QuantSpec
from .amax import (JIT_NONE, JIT_PER_INDEX, JIT_TENSOR, NONE, PER_INDEX, TENSOR, amax_configs,
                   amax_mode, amax_slots, block_max_bits, rht_block_max_bits)
from .groups import group_of
from .rounding import abs_bits
from .runtime import Launcher, autotune, cdiv, next_pow2, num_sms, prune_wide_tiles
from .tiles import load_col_blocks


@triton.jit
def _fold_groups(acc, m, g, GP: tl.constexpr):
    """acc (GP,) int32 with each group's maximum of m (X,) folded in, g (X,) the groups of m's
    entries (entries of a group >= GP are dropped)."""
    hit = g[:, None] == tl.arange(0, GP)[None, :]
    return tl.maximum(acc, tl.max(tl.where(hit, m[:, None], 0), axis=0))


@autotune(configs=amax_configs(), key=["M", "K", "ROW", "COL", "COL_RHT", "GP"],
          prune=prune_wide_tiles(lambda c: 16 * c.kwargs["BC"]))
@triton.jit
def _grouped_amax_kernel(x_ptr, M, K, stride_m, stride_k, offs_ptr, G, signs_ptr, out_ptr, col_off,
                         ROW: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                         GP: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, P: tl.constexpr):
    """Group maxima of |x|, a persistent grid over (16 BB, 16 BC) tiles read as column blocks (16
    tokens of one column in a thread's registers, the blocks of the columnwise copy): ROW per group
    (TENSOR, (G,)) or per row (PER_INDEX, (M,)) from ``out_ptr``; COL of x or of its RHT along the
    tokens (COL_RHT), per group (G,) or per group and column (G, K) from ``out_ptr + col_off``;
    the fp32 output taken as int32 bits (atomic max on the bits), as ``amax._amax_kernel``.
    Per-group maxima are folded in registers, one slot per group (GP >= G slots), and go out with
    one atomic max per group and program at the end: atomics on the same few addresses from every
    tile measured half the dense amax's bandwidth. Per-index maxima take one atomic per element
    and tile. Token blocks past the last group are skipped."""
    row_ptr = out_ptr.to(tl.pointer_type(tl.int32))
    col_ptr = row_ptr + col_off
    signs = tl.load(signs_ptr + tl.arange(0, 16)) if COL_RHT else None
    row_acc = tl.zeros((GP,), dtype=tl.int32)
    col_acc = tl.zeros((GP,), dtype=tl.int32)
    n_k = tl.cdiv(K, 16 * BC)
    for tile in range(tl.program_id(0), tl.cdiv(M, 16 * BB) * n_k, tl.num_programs(0)):
        k = (tile % n_k) * (16 * BC) + tl.arange(0, 16 * BC)
        b = (tile // n_k) * BB + tl.arange(0, BB)
        t = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)  # t[a, d, j] = x[16 b[d] + j, k[a]]
        g = group_of(16 * b, offs_ptr, G)
        ok = g < G
        tile_max = block_max_bits(t)  # (16 BC, BB)
        if ROW == JIT_TENSOR:
            row_acc = _fold_groups(row_acc, tl.max(tile_max, axis=0), g, GP)
        if ROW == JIT_PER_INDEX:
            m = b[:, None] * 16 + tl.arange(0, 16)[None, :]
            tl.atomic_max(row_ptr + m, tl.max(abs_bits(t.to(tl.float32)), axis=0),
                          mask=(m < M) & ok[:, None])
        if COL != JIT_NONE:
            col_max = tile_max
            if COL_RHT:
                y = t.to(tl.float32)
                col_max = rht_block_max_bits(y, signs, t.dtype, False)
                if tl.max(tl.max(col_max, axis=1), axis=0) >= 0x7F800000:  # Inf or NaN: take again
                    col_max = rht_block_max_bits(y, signs, t.dtype, True)
            if COL == JIT_TENSOR:
                col_acc = _fold_groups(col_acc, tl.max(col_max, axis=0), g, GP)
            if COL == JIT_PER_INDEX:
                tl.atomic_max(col_ptr + g[None, :] * K + k[:, None], col_max,
                              mask=ok[None, :] & (k < K)[:, None])
    j = tl.arange(0, GP)
    if ROW == JIT_TENSOR:
        tl.atomic_max(row_ptr + j, row_acc, mask=j < G)
    if COL == JIT_TENSOR:
        tl.atomic_max(col_ptr + j, col_acc, mask=j < G)


_GROUPED_AMAX = Launcher(_grouped_amax_kernel)


def grouped_amax_pass(x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec],
                      col: Optional[QuantSpec], signs: Optional[torch.Tensor] = None):
    """The amaxes ``grouped_quantize.quantize_grouped`` needs for copies ``row`` and ``col`` of x
    (M, K), from one read: (row amax or None, column amax or None), fp32 device tensors before any
    amax_scale factor: row (G,) per group or (M,) per row; column (G,) or (G, K), of the RHT along
    the tokens when ``col.rht`` without amax_scale (``signs``: the (16,) fp32 RHT signs on x's
    device). Groups without tokens have amax 0. ``offs``: the int32 (G,) group ends (``groups``);
    the caller checks x and offs."""
    m, k = x.shape
    n_groups = offs.shape[0]
    col_rht = bool(col and col.rht and col.amax_scale is None)
    r_mode, c_mode = amax_mode(row), amax_mode(col)
    shared = r_mode == TENSOR and c_mode == TENSOR and not col_rht
    if shared:  # one per-group amax of x serves both copies
        c_mode = NONE
    n_row = amax_slots(r_mode, m, n_groups)
    n_col = amax_slots(c_mode, n_groups * k, n_groups)
    out = torch.zeros(n_row + n_col, dtype=torch.float32, device=x.device)
    sms = num_sms(x.device)
    grid = lambda meta: (min(cdiv(m, 16 * meta["BB"]) * cdiv(k, 16 * meta["BC"]),
                             sms * meta["P"]),)
    if m and k and n_groups:
        _GROUPED_AMAX[grid](x, m, k, x.stride(0), x.stride(1), offs, n_groups,
                            signs if col_rht else out, out, n_row,
                            ROW=r_mode, COL=c_mode, COL_RHT=col_rht, GP=next_pow2(n_groups))
    row_amax = out[:n_row] if row else None
    col_amax = out[n_row:].view(n_groups, k) if c_mode == PER_INDEX else out[n_row:]
    if shared:
        col_amax = row_amax if row else None
    return row_amax, (col_amax if col else None)

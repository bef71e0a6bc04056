"""Block tiles of the quantize and amax kernels, and register-axis helpers on them.

A program loads its tile as row blocks (:func:`load_row_blocks`) or column blocks
(:func:`load_col_blocks`): a (rows, blocks, 16) or (columns, blocks, 16) tensor with each block's
16 elements in one thread's registers. The helpers below reduce (:func:`abs_max16`), join
(:func:`join16`) and pack (:func:`pack16`) along that in-register axis, with no data exchange
between threads; Triton picks the thread layout of the other two axes and converts layouts before
the stores.
"""

import triton
import triton.language as tl

from .rounding import abs_bits

@triton.jit
def load_row_blocks(x_ptr, r, c, n_rows, n_cols, stride_r, stride_c, valid=True):
    """Row blocks of a 2D tile: T[a, b, i] = x[r[a], 16 c[b] + i] as a (len(r), len(c), 16) tensor
    in the matrix dtype (zeros outside the matrix), the last axis in a thread's registers (two
    runs of 8, i.e. 16-byte loads for 2-byte dtypes, joined with ``tl.join``). ``valid`` (scalar)
    masks the whole load (a prefetch past the program's last tile). Offsets are int64 (a matrix
    may have 2**31 elements or more)."""
    cols = c[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    rr = r[:, None, None]
    ptr = x_ptr + rr.to(tl.int64) * stride_r + cols.to(tl.int64) * stride_c
    ok = (rr < n_rows) & valid
    lo = tl.load(ptr, mask=ok & (cols < n_cols), other=0.0)
    hi = tl.load(ptr + 8 * stride_c, mask=ok & (cols + 8 < n_cols), other=0.0)
    t = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [a, b, i // 8, i % 8]
    return tl.reshape(t, (t.shape[0], t.shape[1], 16))


@triton.jit
def load_col_blocks(x_ptr, k, b, n_rows, n_cols, stride_r, stride_c, valid=True):
    """Column blocks of a 2D tile: T[a, d, j] = x[16 b[d] + j, k[a]] as a (len(k), len(b), 16)
    tensor in the matrix dtype (zeros outside), the last axis in registers: 16 loads of
    (len(k), len(b)) whose lanes run along the matrix rows' contiguous axis (coalesced; in a
    pair kernel they hit the lines the rowwise loads just brought in). Offsets are int64."""
    t = ()
    kk = k[:, None]
    ok = (kk < n_cols) & valid
    base = x_ptr + (b[None, :] * 16).to(tl.int64) * stride_r + kk.to(tl.int64) * stride_c
    for j in tl.static_range(16):
        r = b[None, :] * 16 + j
        t = t + (tl.load(base + j * stride_r, mask=(r < n_rows) & ok, other=0.0),)
    return join16(t)


@triton.jit
def _join_tree(t):
    """16-tuple of equally shaped tensors -> one tensor with 4 new trailing axes of 2, the bits of
    the tuple index high first (so a reshape to 16 gives t[j] at j)."""
    p = ()
    for k in tl.static_range(8):
        p = p + (tl.join(t[k], t[k + 8]),)
    q = ()
    for k in tl.static_range(4):
        q = q + (tl.join(p[k], p[k + 4]),)
    return tl.join(tl.join(q[0], q[2]), tl.join(q[1], q[3]))


@triton.jit
def join16(t):
    """16-tuple of (A, B) tensors -> (A, B, 16) with t[j] at [:, :, j]."""
    r = _join_tree(t)
    return tl.reshape(r, (r.shape[0], r.shape[1], 16))


@triton.jit
def pack16(c, mul16):
    """(A, B, 16) uint32 nibbles -> (A, B, 2) uint32 words (elements 0-7, 8-15), element 0 in the
    lowest nibble. ``mul16`` is the integer 16 passed at run time, so that the shift-adds compile
    to integer multiply-adds (FMA pipe) rather than shifts (ALU pipe)."""
    A: tl.constexpr = c.shape[0]
    B: tl.constexpr = c.shape[1]
    lo, hi = tl.split(tl.reshape(c, (A, B, 8, 2)))
    c = lo + hi * mul16
    lo, hi = tl.split(tl.reshape(c, (A, B, 4, 2)))
    c = lo + hi * (mul16 * mul16)
    lo, hi = tl.split(tl.reshape(c, (A, B, 2, 2)))
    return lo + hi * (mul16 * mul16 * mul16 * mul16)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max16(y):
    """max |y| over the last axis of (A, B, 16) fp32, NaN-propagating (one max.NaN per element;
    the bits of a NaN result are platform-defined, its E4M3 code is 0x7F or 0xFF)."""
    return tl.reduce(tl.abs(y), 2, max_nan)


@triton.jit
def abs_max16_bits(y):
    """max |y| over the last axis of (A, B, 16) floats as integer bits of the input width (int16
    or int32; ordered like the magnitudes, NaN above Inf), so that no fp32 copy of y is made."""
    if y.dtype.primitive_bitwidth == 16:
        return tl.max(y.to(tl.int16, bitcast=True) & 0x7FFF, axis=2).to(tl.int16)
    else:
        return tl.max(abs_bits(y.to(tl.float32)), axis=2)


@triton.jit
def bits_to_float(m, dtype: tl.constexpr):
    """Inverse of :func:`abs_max16_bits`: the magnitude bits of a ``dtype`` value as fp32."""
    return m.to(dtype, bitcast=True).to(tl.float32)

"""Shared ``@triton.jit`` helpers of the NVFP4 quantization and amax kernels.

Everything here is bit-exact with ``nvfp4_recipe.reference`` on the GPU and under
``TRITON_INTERPRET=1``: roundings are done with integer bit operations or with fp32 additions whose
single rounding is the one wanted (the interpreter truncates fp32 -> fp8 casts; on the GPU the SR
rounding takes one add rounded toward +Inf in inline PTX, which the interpreter lacks, so it runs
the portable form there), divisions with ``div_rn`` (Triton's fp32 ``/`` is approximate on the
GPU), and the stochastic-rounding bits come from Philox-4x32-10 with a uint32 counter, the stream
of ``tl.randint4x`` (:func:`philox4x32`).

Tile forms. The quantize and amax kernels use block tiles (``load_row_blocks``,
``load_col_blocks``): a (rows, blocks, 16) or (columns, blocks, 16) tensor per program with each
block's 16 elements in one thread's registers; the block helpers below (``quantize_block``,
``rht16``, ``pack16``, ...) work on any (A, B, 16) tensor. A block is reduced, transformed
(Hadamard butterfly) and packed along that in-register axis, with no data exchange between threads;
Triton picks the thread layout of the other two axes and converts layouts before the stores.

The elementwise code is arranged for Hopper's pipes: integer/logic/compare/min-max instructions
issue at half the rate of fp32 add/multiply/FMA and integer multiply-add, so the E2M1 rounding and
the packing lean on the latter where that stays exact.
"""

import os

import triton
import triton.language as tl

from .gemm import interpreting


def prune_wide_tiles(tile_cols):
    """An autotune ``early_config_prune``: drops the configs whose tile spans more columns
    (``tile_cols(config)``) than the matrix's K rounded up to a power of two (at least 128), whose
    lanes would mostly be masked off (e.g. K = 512 in a small model), keeping at least the last
    config; with NVFP4_AUTOTUNE=0 keeps only the first survivor (no tuning runs)."""
    def prune(configs, named_args, **kwargs):
        width = max(128, triton.next_power_of_2(named_args["K"]))
        fit = [c for c in configs if tile_cols(c) <= width] or list(configs[-1:])
        return fit[:1] if os.environ.get("NVFP4_AUTOTUNE") == "0" else fit
    return prune


_ONE_BITS = tl.constexpr(0x3F800000)  # fp32 1.0
_MAGIC_BITS = tl.constexpr(0x4B000000)  # fp32 2**23: its ulp is 1, so adding it rounds to an integer
HUGE_INV = tl.constexpr(2.0**122)  # 1 / s_outer above this can make (1 / s_outer) / scale overflow
_PTX = tl.constexpr(not interpreting())  # inline PTX on the GPU; the interpreter runs none


@triton.jit
def scalar_arg(arg, IS_PTR: tl.constexpr):
    """A scalar kernel argument given either by value or as a pointer to a device scalar."""
    if IS_PTR:
        return tl.load(arg)
    else:
        return arg


@triton.jit
def div_rn(a, b):
    """IEEE fp32 a / b, round to nearest even, with broadcasting (``/`` is approximate on GPUs)."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def abs_bits(x):
    """|x| of fp32 ``x`` as int32 bits: ordered like the floats, every NaN above +Inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def outer_scale(amax, mult, MULT: tl.constexpr):
    """Spec item 1: s_outer = amax / 2688 (amax times ``mult`` first when MULT, item 8).

    Returns (s_outer, s_div, 1 / s_div) with s_div = 1 where s_outer == 0 (item 10).
    """
    if MULT:
        amax = amax * mult
    s_outer = div_rn(amax, tl.zeros_like(amax) + 2688.0)
    s_div = tl.where(s_outer == 0.0, 1.0, s_outer)
    return s_outer, s_div, div_rn(tl.zeros_like(s_div) + 1.0, s_div)


@triton.jit
def e4m3_rne(s):
    """Round fp32 ``s`` (in [2**-6, 448], or NaN) to E4M3, nearest-even, by bit operations.

    Returns (code, value): the float8_e4m3fn bit pattern as int32 and its exact fp32 value.
    NaN gives code 0x7F | sign and the value torch's E4M3 -> fp32 cast gives (sign | 0x7FF00000).
    """
    b = s.to(tl.int32, bitcast=True)
    r = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, ties to even
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    code = tl.where(nan, ((b >> 24) & 0x80) | 0x7F, (r >> 20) - 960)  # 960 = (127 - 7) << 3
    value = tl.where(nan, (b & -0x80000000) | 0x7FF00000, r).to(tl.float32, bitcast=True)
    return code, value


@triton.jit
def block_scale(bamax, s_div, inv_div):
    """Spec items 2-3 for blocks with fp32 amax ``bamax`` (s_div, inv_div broadcast against it).

    Returns (E4M3 code of the block scale as int32, its fp32 value, fp32 multiplier
    (1 / s_div) / scale).
    """
    s = div_rn(div_rn(bamax, tl.zeros_like(bamax) + 6.0), s_div)
    s = tl.where(s > 448.0, 448.0, tl.where(s < 0.015625, 0.015625, s))  # NaN passes, as torch.clamp
    code, value = e4m3_rne(s)
    return code, value, div_rn(inv_div, value)


# ----------------------------------------------------------------------------------------------
# E2M1 rounding, elementwise. Both return the code magnitude (0-7) plus an offset, as uint32.
# ----------------------------------------------------------------------------------------------
RN_OFFSET = tl.constexpr(0x4B000000)
SR_OFFSET = tl.constexpr(0)


@triton.jit
def e2m1_rn(v, CLAMP: tl.constexpr):
    """E2M1 round-to-nearest-even code of |v|, plus RN_OFFSET (the bits of 2**23 + code).

    The code as a function of a = |v| is RNE(f(a)) with f = min(2a, a + 2, a / 2 + 4), the
    piecewise-linear map taking the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} to 0..7 (ties map to
    half-integers, and even codes are the even-mantissa values). RNE is monotonic, so
    RNE(f(a)) = min(RNE(2a), RNE(a) + 2, RNE(a / 2) + 4); each term is one exact fp32 rounding of
    a + 2**23 + constant. Valid for a < 6.5, always true with a measured amax (a block scale
    rounded down gives at most 6.375); CLAMP bounds a by 6 first (for estimated amaxes).
    A NaN ``v`` gives a NaN pattern: callers mask it.
    """
    a = tl.abs(v)
    if CLAMP:
        a = tl.minimum(a, 6.0)
    c = tl.minimum(tl.minimum(a * 2.0 + 8388608.0, a + 8388610.0), a * 0.5 + 8388612.0)
    return c.to(tl.uint32, bitcast=True)


@triton.jit
def _add_one_rp(a):
    """fp32 a + 1 rounded toward +Inf (PTX ``add.rp.f32``: one FADD on the GPU)."""
    return tl.inline_asm_elementwise("add.rp.f32 $0, $1, 0f3F800000;", "=f,f", [a],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def e2m1_sr(v, r):
    """E2M1 stochastic-rounding code of min(|v|, 6) (plus SR_OFFSET = 0) for uint32 16-bit
    randoms ``r``. (|v| reaches 6.375 when a block scale rounds down; 6 must not round up.)

    ``reference.round_sr`` rounds up iff r * 2**-16 < (a - lo) / (hi - lo), i.e. iff the fraction
    scaled by 2**22, f, exceeds 64 r. In the code space scaled by 2**22 (value V = code * 2**22 + f)
    that is a carry out of ceil(V) + 0x3FFFFF - 64 r into bit 22. On [1, 6], V is the fp32 bit
    pattern minus 126 * 2**23 (an integer); below 1 it is a * 2**23, whose ceiling comes exactly
    from the rounded sum a * 2**23 + 2**23 and the sign of its rounding error.
    On the GPU, a + 1 rounded toward +Inf (PTX ``add.rp``) has the bits 0x3F800000 + ceil(a * 2**23)
    below 1, so the ceiling costs one add; from 1 on, that sum minus 0x3F800000 is below the
    bit-pattern V, and below 1 above it, so a signed max replaces the select (about 3.6 fewer
    SASS instructions an element on sm90, the gradient pair 6% faster; the same codes, which the
    GPU tests check against the reference and the CPU tests check for the portable path).
    A NaN ``v`` gives an arbitrary code (the GPU's min returns 6, the interpreter's NaN): callers
    mask it, as for :func:`e2m1_rn`.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    n = a.to(tl.uint32, bitcast=True)
    normal = n + ((0x3FFFFF - (252 << 22)) & 0xFFFFFFFF)
    if _PTX:
        small = (_add_one_rp(a).to(tl.uint32, bitcast=True)
                 + ((0x3FFFFF - _ONE_BITS) & 0xFFFFFFFF))
        w = tl.maximum(small.to(tl.int32, bitcast=True), normal.to(tl.int32, bitcast=True))
        w = w.to(tl.uint32, bitcast=True)
    else:
        x = a * 8388608.0
        rm = x + 8388608.0  # 2**23 + round(x)
        below = (rm - 8388608.0) - x  # negative iff round(x) < x: then ceil(x) = round(x) + 1
        small = (rm.to(tl.uint32, bitcast=True) + (below.to(tl.uint32, bitcast=True) >> 31)
                 + ((0x3FFFFF - _MAGIC_BITS) & 0xFFFFFFFF))
        w = tl.where(n < _ONE_BITS, small, normal)
    return (w - (r << 6)) >> 22


# ----------------------------------------------------------------------------------------------
# Register-axis helpers for (A, B, 16) blocks
# ----------------------------------------------------------------------------------------------
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
def _mul_wide(a, b: tl.constexpr):
    p = a.to(tl.uint64) * b
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32(seed, counter):
    """Philox-4x32-10 (Salmon et al., SC 2011), the same four uint32 words as
    ``tl.randint4x(seed, counter)`` and ``reference.philox4x32``, for a uint32 ``counter`` tensor
    and an integer scalar ``seed`` (its low and high 32 bits are the key). Each round's two
    32 x 32-bit products are 64-bit multiplies, one instruction each (``tl.randint4x`` takes a
    high and a low multiply each): 5% off the gradient pair on the H200 (docs/benchmarks.md)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = counter
    c1 = counter * 0
    c2 = c1
    c3 = c1
    for _ in tl.static_range(10):
        hi_b, lo_b = _mul_wide(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul_wide(c0, 0xD2511F53)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def bits16(seed, counter):
    """SR randoms of 16-element blocks as an (A, B, 16) uint32 tensor (``reference.sr_bits``):
    element j takes half j % 2 of word (j % 8) // 2 of ``randint4x(seed, counter + j // 8)``;
    ``counter`` (A, B) uint32 is the Philox counter of elements 0-7 of each block."""
    halves = ()
    for k in tl.static_range(2):
        w0, w1, w2, w3 = philox4x32(seed, counter + k)
        halves = halves + (w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16,
                           w2 & 0xFFFF, w2 >> 16, w3 & 0xFFFF, w3 >> 16)
    return join16(halves)


@triton.jit
def _butterfly(y, h: tl.constexpr):
    A: tl.constexpr = y.shape[0]
    B: tl.constexpr = y.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(y, (A, B, 16 // (2 * h), 2, h)), (0, 1, 2, 4, 3)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), (A, B, 16))


@triton.jit
def _hadamard8x2(y, signs):
    """The first three stages of :func:`hadamard16`: signs, butterflies at distance 1, 2, 4."""
    y = y * signs[None, None, :]
    y = _butterfly(y, 1)
    y = _butterfly(y, 2)
    return _butterfly(y, 4)


@triton.jit
def hadamard16(y, signs):
    """The unscaled 16-point RHT of (A, B, 16) blocks along the last axis, in the reference's fixed
    fp32 order: times ``signs`` ((16,) fp32 +-1, exact), then butterflies at distance 1, 2, 4, 8
    with (a, b) -> (a + b, a - b)."""
    return _butterfly(_hadamard8x2(y, signs), 8)


@triton.jit
def hadamard16_abs_max(y, signs):
    """max |hadamard16(y, signs)| over the last axis of (A, B, 16) fp32 blocks, the last
    butterfly stage folded into the maximum: max(|a + b|, |a - b|) = |a| + |b| in fp32 too
    (rounding is monotone and symmetric in sign), so one add replaces an add, a subtraction and a
    maximum. Exact except where a and b are both infinite (a + b or a - b is then NaN, this gives
    Inf): a result of Inf or NaN must be recomputed with ``abs_max16(hadamard16(y, signs))``."""
    A: tl.constexpr = y.shape[0]
    B: tl.constexpr = y.shape[1]
    y = _hadamard8x2(y, signs)
    a, b = tl.split(tl.permute(tl.reshape(y, (A, B, 2, 8)), (0, 1, 3, 2)))  # elements j, j + 8
    return tl.reduce(tl.abs(a) + tl.abs(b), 2, _max_nan)


@triton.jit
def rht16(y, signs):
    """16-point random Hadamard transform of (A, B, 16) blocks along the last axis (spec item 7):
    :func:`hadamard16` times 0.25."""
    return hadamard16(y, signs) * 0.25


@triton.jit
def _codes(v, bits, SR: tl.constexpr, CLAMP: tl.constexpr, SAFE: tl.constexpr):
    if SR:
        c = e2m1_sr(v, bits)
    else:
        c = e2m1_rn(v, CLAMP or SAFE)
    if SAFE:
        c = tl.where(v != v, SR_OFFSET if SR else RN_OFFSET, c)
    return c


@triton.jit
def nibbles(v, bits, huge, mul2, SR: tl.constexpr, CLAMP: tl.constexpr):
    """(code magnitudes + offset, sign bits) of scaled values ``v``, uint32 tensors shaped like v.

    huge (scalar): the block multipliers may have overflowed to +Inf (tiny amax), giving +-Inf and
    NaN values; they are then clamped / zeroed one by one (a branch: the common case pays nothing).
    The sign is the sign bit of v, as ``formats.e2m1_encode_rn`` takes it.
    """
    if huge:
        c = _codes(v, bits, SR, CLAMP, True)
    else:
        c = _codes(v, bits, SR, CLAMP, False)
    # the sign bit as a multiply-high by 2 (FMA pipe; ``mul2`` = 2 at run time keeps it one)
    return c, tl.umulhi(v.to(tl.uint32, bitcast=True), mul2)


@triton.jit
def finish_half(code, sign, bad, SR: tl.constexpr):
    """A uint32 word of 8 packed nibbles from the base-16 sums of their codes (with offsets) and
    of their sign bits; ``bad`` zeroes the magnitudes of blocks with a NaN multiplier."""
    OFFSET: tl.constexpr = SR_OFFSET if SR else RN_OFFSET
    return tl.where(bad, 0, code - ((OFFSET * 0x11111111) & 0xFFFFFFFF)) + sign * 8


@triton.jit
def finish_words(code, sign, bad, SR: tl.constexpr):
    """:func:`finish_half` of (..., 2) sums (elements 0-7, 8-15) -> (...) uint64 words."""
    lo, hi = tl.split(finish_half(code, sign, bad, SR))
    return lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)


@triton.jit
def encode16(v, bits, bad, huge, mul16, SR: tl.constexpr, CLAMP: tl.constexpr):
    """E2M1 codes of scaled block values ``v`` (A, B, 16), packed into (A, B) uint64 words.

    bad: (A, B) true for blocks with a NaN multiplier (non-finite data): magnitudes 0.
    bits: SR randoms shaped like v (SR only). huge: see :func:`nibbles`.
    """
    c, s = nibbles(v, bits, huge, (mul16 // 8).to(tl.uint32), SR, CLAMP)
    return finish_words(pack16(c, mul16), pack16(s, mul16), bad[:, :, None], SR)


@triton.jit
def inner16(v, bits, scale, huge, mul16, SR: tl.constexpr, CLAMP: tl.constexpr):
    """Inner values (E2M1 value x block scale) of scaled block values ``v`` (A, B, 16) whose block
    scales are ``scale`` ((A, B) fp32 E4M3 values): (A, B, 16) float16, exact, what
    ``gemm.dequantize_inner`` gives for the codes :func:`encode16` writes (NaN for a NaN scale).

    A code (s e1 e0 m) becomes the E4M3 byte (s 0 0 e1 e0 m 0 0), worth value * 2**-6, which the
    conversion to fp16 (hardware on sm89+) and one fp16 multiply by scale * 64 finish, exactly
    (0 or 2**-10 ... 2688, at most 6 significant bits); the code offsets times 4 vanish mod 256.
    """
    mul4 = mul16 // 4
    c, s = nibbles(v, bits, huge, (mul4 // 2).to(tl.uint32), SR, CLAMP)
    e4m3 = (c * mul4 + s * (mul4 * 32)).to(tl.uint8)
    return e4m3.to(tl.float8e4nv, bitcast=True).to(tl.float16) * (scale * 64.0).to(tl.float16)[:, :, None]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max16(y):
    """max |y| over the last axis of (A, B, 16) fp32, NaN-propagating (one max.NaN per element;
    the bits of a NaN result are platform-defined, its E4M3 code is 0x7F or 0xFF)."""
    return tl.reduce(tl.abs(y), 2, _max_nan)


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


@triton.jit
def quantize_block(y, s_div, inv_div, huge, seed, counter, mul16, SR: tl.constexpr,
                   CLAMP: tl.constexpr, INNER: tl.constexpr):
    """Quantize fp32 (A, B, 16) blocks along the last axis (spec items 2-6).

    s_div, inv_div: outer scale divisor and its reciprocal, broadcasting against (A, B).
    huge: scalar, true if some inv_div >= 2**122 (then 1/s_div/scale may overflow: exact slow path).
    counter: (A, B) uint32 Philox counter of elements 0-7 of each block (SR only).
    Returns ((A, B) uint64 words of the 16 packed codes, (A, B) int32 E4M3 scale codes), or with
    INNER the (A, B, 16) float16 inner values of :func:`inner16` (and the scale codes).
    """
    scode, scale, recip = block_scale(abs_max16(y), s_div, inv_div)
    v = y * recip[:, :, None]
    bits = 0
    if SR:
        bits = bits16(seed, counter)
    if INNER:
        out = inner16(v, bits, scale, huge, mul16, SR, CLAMP)
    else:
        out = encode16(v, bits, recip != recip, huge, mul16, SR, CLAMP)
    return out, scode


# ----------------------------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------------------------
@triton.jit
def load_row_blocks(x_ptr, r, c, n_rows, n_cols, stride_r, stride_c, valid=True):
    """Row blocks of a 2D tile: T[a, b, i] = x[r[a], 16 c[b] + i] as a (len(r), len(c), 16) tensor
    in the matrix dtype (zeros outside the matrix), the last axis in a thread's registers (two
    runs of 8, i.e. 16-byte loads for 2-byte dtypes, joined with ``tl.join``). ``valid`` (scalar)
    masks the whole load (a prefetch past the program's last tile)."""
    cols = c[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    rr = r[:, None, None]
    ptr = x_ptr + rr * stride_r + cols * stride_c
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
    pair kernel they hit the lines the rowwise loads just brought in)."""
    t = ()
    kk = k[:, None]
    ok = (kk < n_cols) & valid
    for j in tl.static_range(16):
        r = b[None, :] * 16 + j
        t = t + (tl.load(x_ptr + r * stride_r + kk * stride_c, mask=(r < n_rows) & ok, other=0.0),)
    return join16(t)

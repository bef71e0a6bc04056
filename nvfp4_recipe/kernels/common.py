"""Shared ``@triton.jit`` helpers of the NVFP4 quantization and amax kernels.

Everything here is bit-exact with ``nvfp4_recipe.reference`` (TransformerEngine's NVFP4 chain) on the
GPU and under ``TRITON_INTERPRET=1``: E4M3, E2M1 and bf16 roundings are done with integer bit
operations or with fp32 additions whose single rounding is the one wanted (the interpreter truncates
fp32 -> bf16/fp8 casts), divisions with ``div_rn`` (Triton's fp32 ``/`` is approximate on the GPU)
and, where a result can be an fp32 subnormal, in fp64 or on scaled operands, and the
stochastic-rounding bits come from Philox-4x32-10 with a uint32 counter, the stream of
``tl.randint4x`` (:func:`philox4x32`).

Tile forms. The quantize and amax kernels use block tiles (``load_row_blocks``,
``load_col_blocks``): a (rows, blocks, 16) or (columns, blocks, 16) tensor per program with each
block's 16 elements in one thread's registers; the block helpers below (``quantize_block``,
``rht16``, ``pack16``, ...) work on any (A, B, 16) tensor. A block is reduced, transformed
(Hadamard butterfly) and packed along that in-register axis, with no data exchange between threads;
Triton picks the thread layout of the other two axes and converts layouts before the stores.

The elementwise code is arranged for Hopper's pipes: integer/logic/compare/min-max instructions
issue at half the rate of fp32 add/multiply/FMA and integer multiply-add, so the packing leans on
the latter where that stays exact.
"""

import os

import triton
import triton.language as tl



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


FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1 / 6), TE's reciprocal(6.0)


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
def outer_scales(amax, mult, MULT: tl.constexpr):
    """Spec item 1 for fp32 ``amax`` (times ``mult`` first when MULT, item 8): (S_enc * (1/6),
    S_dec) with ``S_enc = min(2688 / amax, FLT_MAX)`` and ``S_dec = 1 / S_enc``. S_dec is divided
    in fp64, which rounds it correctly also where it is an fp32 subnormal (amax below about
    3e-35); amax 0 gives S_enc = FLT_MAX, Inf gives 0 and NaN gives NaN (non-finite S_dec)."""
    if MULT:
        amax = amax * mult
    s_enc = div_rn(tl.zeros_like(amax) + 2688.0, amax)
    s_enc = tl.where(s_enc > FLT_MAX, FLT_MAX, s_enc)  # NaN passes, as torch.clamp
    s_dec = (1.0 / s_enc.to(tl.float64)).to(tl.float32)  # fp64 "/" is IEEE division
    return s_enc * ONE_SIXTH, s_dec


@triton.jit
def e4m3_rne(s):
    """Round fp32 ``s`` (in [0, 448], or NaN) to E4M3, nearest-even, by bit operations.

    Returns (code, value): the float8_e4m3fn bit pattern as int32 and its exact fp32 value. Below
    2**-6 the code is the subnormal k * 2**-9 with k = RNE(s * 2**9) (0 for s <= 2**-10).
    NaN gives code 0x7F | sign and the value torch's E4M3 -> fp32 cast gives (sign | 0x7FF00000).
    """
    b = s.to(tl.int32, bitcast=True)
    r = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, ties to even
    k = s * 512.0 + 8388608.0  # 2**23 + RNE(s * 2**9): one rounding, the product is exact
    sub = b < 0x3C800000  # s < 2**-6
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    code = tl.where(sub, k.to(tl.int32, bitcast=True) - 0x4B000000,
                    (r >> 20) - 960)  # 960 = (127 - 7) << 3
    value = tl.where(sub, (k - 8388608.0) * 0.001953125, r.to(tl.float32, bitcast=True))
    code = tl.where(nan, ((b >> 24) & 0x80) | 0x7F, code)
    value = tl.where(nan, ((b & -0x80000000) | 0x7FF00000).to(tl.float32, bitcast=True), value)
    return code, value


@triton.jit
def rcp_rn(p):
    """1 / p in fp32, round to nearest even, for p >= 0 (or NaN): correct also for subnormal p,
    which are scaled by 2**64 first (the division may flush subnormal operands to zero); the
    result is then at least 2**-126 * 2**64, so scaling it back is exact (or overflows to Inf)."""
    tiny = p < 1.0842021724855044e-19  # 2**-63
    q = div_rn(tl.zeros_like(p) + 1.0, tl.where(tiny, p * 1.8446744073709552e19, p))
    return tl.where(tiny, q * 1.8446744073709552e19, q)


@triton.jit
def block_scale(bamax, s_enc6, s_dec):
    """Spec items 2-3 for blocks with fp32 amax ``bamax`` (s_enc6 = S_enc * (1/6) and S_dec from
    :func:`outer_scales`, broadcasting against it): ``sf = e4m3(clamp(min(bamax * s_enc6,
    FLT_MAX), -448, 448))`` and the value encode scale ``min(1 / (sf * S_dec), FLT_MAX)``.

    Returns (E4M3 code of sf as int32, its fp32 value, the fp32 encode scale); a NaN block (or
    S_dec) gives a NaN encode scale, which callers use to mask the block.
    """
    s = bamax * s_enc6
    s = tl.where(s > 448.0, 448.0, s)  # min(., FLT_MAX) then the clamp; NaN passes, as torch.clamp
    code, value = e4m3_rne(s)
    enc = rcp_rn(value * s_dec)
    return code, value, tl.where(enc > FLT_MAX, FLT_MAX, enc)


# ----------------------------------------------------------------------------------------------
# E2M1 rounding, elementwise. Both return the code magnitude (0-7) plus an offset, as uint32, of
# min(|v|, 6): values past 6 saturate (a block scale rounded down, or a zero scale whose encode
# scale is FLT_MAX). A NaN ``v`` gives an arbitrary code: callers mask NaN blocks.
# ----------------------------------------------------------------------------------------------
RN_OFFSET = tl.constexpr(0x4B000000)
SR_OFFSET = tl.constexpr(0)


@triton.jit
def e2m1_rn(v):
    """E2M1 round-to-nearest-even code of min(|v|, 6), plus RN_OFFSET (the bits of 2**23 + code).

    The code as a function of a = |v| is RNE(f(a)) with f = min(2a, a + 2, a / 2 + 4), the
    piecewise-linear map taking the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} to 0..7 (ties map to
    half-integers, and even codes are the even-mantissa values). RNE is monotonic, so
    RNE(f(a)) = min(RNE(2a), RNE(a) + 2, RNE(a / 2) + 4); each term is one exact fp32 rounding of
    a + 2**23 + constant.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    c = tl.minimum(tl.minimum(a * 2.0 + 8388608.0, a + 8388610.0), a * 0.5 + 8388612.0)
    return c.to(tl.uint32, bitcast=True)


@triton.jit
def e2m1_sr(v, r):
    """E2M1 stochastic-rounding code of min(|v|, 6) (plus SR_OFFSET = 0) for 8-bit randoms ``r``
    (uint32 in [0, 256)): TE's rule (``reference.round_sr``), t = a + (r / 256) * step(a) in fp32,
    then the largest grid value <= t.

    step(a) = 2**(max(E, 0) - 1) for a in [2**E, 2**(E + 1)), so (r / 256) * step(a) is r times
    the power of two whose bits are max(exponent bits of a, those of 1) - 9 << 23 (exact). t < 8;
    from 1 on the E2M1 grid has two points a binade, so the floor code is the exponent and top
    mantissa bit of t, (bits >> 22) - 252; below 1 it is whether t >= 0.5.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    e = tl.maximum(a.to(tl.uint32, bitcast=True) & 0x7F800000, 0x3F800000)
    # r as a float from its bits (2**23 + r, exact) rather than an int-to-float conversion, which
    # issues at a quarter of the fp32 rate on sm90
    rf = (r | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    t = a + rf * (e - (9 << 23)).to(tl.float32, bitcast=True)
    tb = t.to(tl.int32, bitcast=True)
    return tl.maximum((tb >> 22) - 252, (tb >= 0x3F000000).to(tl.int32)).to(tl.uint32)


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
    """SR randoms of 16-element blocks as an (A, B, 16) uint32 tensor in [0, 256)
    (``reference.sr_bits``): element j takes byte j % 4 of word j // 4 of
    ``randint4x(seed, counter)``; ``counter`` (A, B) uint32 is each block's Philox counter."""
    w0, w1, w2, w3 = philox4x32(seed, counter)
    return join16((w0 & 0xFF, (w0 >> 8) & 0xFF, (w0 >> 16) & 0xFF, w0 >> 24,
                   w1 & 0xFF, (w1 >> 8) & 0xFF, (w1 >> 16) & 0xFF, w1 >> 24,
                   w2 & 0xFF, (w2 >> 8) & 0xFF, (w2 >> 16) & 0xFF, w2 >> 24,
                   w3 & 0xFF, (w3 >> 8) & 0xFF, (w3 >> 16) & 0xFF, w3 >> 24))


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
    :func:`hadamard16` times 0.25, fp32 (round it to the input dtype with :func:`round_to`)."""
    return hadamard16(y, signs) * 0.25


@triton.jit
def round_to(y, dtype: tl.constexpr):
    """fp32 ``y`` rounded to the precision of ``dtype`` (nearest even), as fp32: bf16 by bit
    operations (the interpreter truncates fp32 -> bf16 casts; NaN and Inf are kept), fp16 by
    a cast (exact on both), fp32 unchanged. The transformed RHT operand is rounded so (item 7)."""
    if dtype == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def nibbles(v, bits, SR: tl.constexpr):
    """(code magnitudes + offset, sign bits) of scaled values ``v``, uint32 tensors shaped like v.

    The sign is set for v < 0 (so -0.0 and NaN give +0), as ``formats.e2m1_encode_rn`` takes it.
    """
    if SR:
        c = e2m1_sr(v, bits)
    else:
        c = e2m1_rn(v)
    return c, (v < 0).to(tl.uint32)


@triton.jit
def finish_half(code, sign, bad, SR: tl.constexpr):
    """A uint32 word of 8 packed nibbles from the base-16 sums of their codes (with offsets) and
    of their sign bits; ``bad`` zeroes the magnitudes of blocks with a NaN encode scale."""
    OFFSET: tl.constexpr = SR_OFFSET if SR else RN_OFFSET
    return tl.where(bad, 0, code - ((OFFSET * 0x11111111) & 0xFFFFFFFF)) + sign * 8


@triton.jit
def finish_words(code, sign, bad, SR: tl.constexpr):
    """:func:`finish_half` of (..., 2) sums (elements 0-7, 8-15) -> (...) uint64 words."""
    lo, hi = tl.split(finish_half(code, sign, bad, SR))
    return lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)


@triton.jit
def encode16(v, bits, bad, mul16, SR: tl.constexpr):
    """E2M1 codes of scaled block values ``v`` (A, B, 16), packed into (A, B) uint64 words.

    bad: (A, B) true for blocks with a NaN encode scale (non-finite data): magnitudes 0.
    bits: SR randoms shaped like v (SR only).
    """
    c, s = nibbles(v, bits, SR)
    return finish_words(pack16(c, mul16), pack16(s, mul16), bad[:, :, None], SR)


@triton.jit
def inner16(v, bits, scale, mul16, SR: tl.constexpr):
    """Inner values (E2M1 value x block scale) of scaled block values ``v`` (A, B, 16) whose block
    scales are ``scale`` ((A, B) fp32 E4M3 values): (A, B, 16) float16, exact, what
    ``gemm.dequantize_inner`` gives for the codes :func:`encode16` writes (NaN for a NaN scale).

    A code (s e1 e0 m) becomes the E4M3 byte (s 0 0 e1 e0 m 0 0), worth value * 2**-6, which the
    conversion to fp16 (hardware on sm89+) and one fp16 multiply by scale * 64 finish, exactly
    (0 or 2**-10 ... 2688, at most 6 significant bits); the code offsets times 4 vanish mod 256.
    """
    mul4 = mul16 // 4
    c, s = nibbles(v, bits, SR)
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
def quantize_block(y, s_enc6, s_dec, seed, counter, mul16, SR: tl.constexpr, INNER: tl.constexpr):
    """Quantize fp32 (A, B, 16) blocks along the last axis (spec items 2-6).

    s_enc6, s_dec: S_enc * (1/6) and S_dec (:func:`outer_scales`), broadcasting against (A, B).
    counter: (A, B) uint32 Philox counter of each block (SR only).
    Returns ((A, B) uint64 words of the 16 packed codes, (A, B) int32 E4M3 scale codes), or with
    INNER the (A, B, 16) float16 inner values of :func:`inner16` (and the scale codes).
    """
    scode, scale, enc = block_scale(abs_max16(y), s_enc6, s_dec)
    v = y * enc[:, :, None]
    bits = 0
    if SR:
        bits = bits16(seed, counter)
    if INNER:
        out = inner16(v, bits, scale, mul16, SR)
    else:
        out = encode16(v, bits, enc != enc, mul16, SR)
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

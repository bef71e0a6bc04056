"""E4M3, E2M1 and 16-bit rounding and the NVFP4 scale chain, as ``@triton.jit`` helpers.

TransformerEngine's chain (docs/numerics.md, ``reference.quantize``), bit-exact on the GPU and
under ``TRITON_INTERPRET=1``: roundings are integer bit operations or fp32 additions whose single
rounding is the one wanted (the interpreter truncates fp32 -> bf16/fp8 casts), divisions are
``div_rn`` (Triton's fp32 ``/`` is approximate on the GPU) and, where a result or an operand can be
an fp32 subnormal, done in fp64 or on scaled operands (the division may flush subnormals).

The elementwise code is arranged for Hopper's pipes: integer/logic/compare/min-max instructions
issue at half the rate of fp32 add/multiply/FMA and integer multiply-add, conversions at a quarter.
Compiled for a GPU, the E4M3 and bf16 roundings use the hardware's round-to-nearest conversions
(``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.bf16x2.f32``: one instruction for two values); under the
interpreter (``INTERPRETED``), whose casts truncate, the same roundings by bit operations.
"""

import triton
import triton.language as tl

from .runtime import INTERPRETED

FLT_MAX = tl.constexpr(3.4028234663852886e38)


ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1 / 6), TE's reciprocal(6.0)


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
def outer_scales(amax, amax_scale, HAS_AMAX_SCALE: tl.constexpr,
                 FOUR_OVER_SIX_E4M3_MAX: tl.constexpr = 0):
    """Spec item 1 for fp32 ``amax`` (times ``amax_scale`` first when HAS_AMAX_SCALE, item 8):
    (S_enc * (1/6), S_dec, amax) with ``S_enc = min(2688 / amax, FLT_MAX)`` and
    ``S_dec = 1 / S_enc``; with 4/6 (FOUR_OVER_SIX_E4M3_MAX, its E4M3 bound 256 or 448; 0 without
    4/6) S_enc itself and 6 * that bound in place of 2688. S_dec is divided in fp64, which rounds
    it correctly also where it is an fp32 subnormal (amax below about 3e-35); amax 0 gives
    S_enc = FLT_MAX, Inf gives 0 and NaN gives NaN (non-finite S_dec)."""
    if HAS_AMAX_SCALE:
        amax = amax * amax_scale
    if FOUR_OVER_SIX_E4M3_MAX:
        s_enc = div_rn(tl.zeros_like(amax) + 6.0 * FOUR_OVER_SIX_E4M3_MAX, amax)
    else:
        s_enc = div_rn(tl.zeros_like(amax) + 2688.0, amax)
    s_enc = tl.where(s_enc > FLT_MAX, FLT_MAX, s_enc)  # NaN passes, as torch.clamp
    s_dec = reciprocal(s_enc)
    if FOUR_OVER_SIX_E4M3_MAX:
        return s_enc, s_dec, amax
    else:
        return s_enc * ONE_SIXTH, s_dec, amax


@triton.jit
def reciprocal(s):
    """1 / s of fp32 ``s`` >= 0 (or NaN), round to nearest even, subnormal results included. The
    fp32 :func:`rcp_rn` is exact while the result is normal (s below 2**126: every amax above
    about 2**-114); beyond, all threads take the fp64 division (``/`` is IEEE division in fp64),
    which rounds a subnormal quotient once. A uniform branch: the fp64 code costs nothing where
    it is not taken."""
    if tl.max(s + tl.zeros((1,), tl.float32)) < 8.507059173023462e37:  # 2**126 (NaN: fp64 path)
        r = rcp_rn(s)
    else:
        r = (1.0 / s.to(tl.float64)).to(tl.float32)
    return r


@triton.jit
def e4m3_rne(s):
    """Round fp32 ``s`` (in [0, 448], or NaN) to E4M3, nearest-even, by bit operations.

    Returns (code, value): the float8_e4m3fn bit pattern as int32 and its exact fp32 value. Below
    2**-6 the code is the subnormal k * 2**-9 with k = RNE(s * 2**9) (0 for s <= 2**-10).
    NaN gives code 0x7F | sign and the value torch's E4M3 -> fp32 cast gives (sign | 0x7FF00000).
    On a GPU the hardware conversion rounds (saturating finite values at 448, which s never
    exceeds), and only NaN is patched.
    """
    b = s.to(tl.int32, bitcast=True)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    if not INTERPRETED:
        f8 = s.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        code = tl.where(nan, ((b >> 24) & 0x80) | 0x7F, f8.to(tl.uint8, bitcast=True).to(tl.int32))
        value = tl.where(nan, ((b & -0x80000000) | 0x7FF00000).to(tl.float32, bitcast=True),
                         f8.to(tl.float32))
        return code, value
    r = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, ties to even
    k = s * 512.0 + 8388608.0  # 2**23 + RNE(s * 2**9): one rounding, the product is exact
    sub = b < 0x3C800000  # s < 2**-6
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
    return scale_and_encode(bamax * s_enc6, s_dec)


@triton.jit
def scale_and_encode(s, s_dec):
    """The E4M3 block scale ``sf = e4m3(min(s, 448))`` of fp32 ``s`` >= 0 (or NaN) and the value
    encode scale ``min(1 / (sf * S_dec), FLT_MAX)``: (code as int32, fp32 value, encode scale)."""
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
def e2m1_value(a):
    """The E2M1 grid value nearest to min(a, 6) for fp32 ``a`` >= 0, ties to the even code, in
    one rounding: (a + M) - M with M = 2**(22 + max(E, 0)) for a in [2**E, 2**(E + 1)), whose
    ulp is the grid's spacing there (0.5 below 2, 1 up to 4, 2 up to 6) and whose even
    significands are the grid's even codes. Equals ``decode(e2m1_rn(a))`` on [0, 8]."""
    a = tl.minimum(a, 6.0)
    e = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    m = (e + (22 << 23)).to(tl.float32, bitcast=True)
    return (a + m) - m


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


@triton.jit
def round_to(y, dtype: tl.constexpr):
    """fp32 ``y`` rounded to the precision of ``dtype`` (nearest even), as fp32: bf16 by the
    hardware conversion on a GPU and by bit operations under the interpreter (which truncates
    fp32 -> bf16 casts; NaN and Inf are kept), fp16 by a cast (exact on both), fp32 unchanged. The transformed RHT operand is rounded so (item 7)."""
    if dtype == tl.bfloat16 and not INTERPRETED:
        return y.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    elif dtype == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y

"""4/6 block scaling in the quantize kernels (spec item 11), bit-exact with
``reference.four_over_six_scales``: TransformerEngine's ``_quantize_blockwise_4over6_reference``
(TE main, ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``; arXiv 2512.02010).

A kernel takes 4/6 as three constexprs per copy (:func:`four_over_six_constexprs`):
FOUR_OVER_SIX_E4M3_MAX, 0 without 4/6 (so that a kernel without it compiles to the code it had
before) or the E4M3 bound of its outer scale (256 or 448); FOUR_OVER_SIX_MSE, squared rather than
absolute errors; FOUR_OVER_SIX_FAST_MATH, the error measured on the scaled values. With 4/6, each
block (or 16x16 tile) gets the scale of the candidate (map to 4 or to 6) whose RN error is smaller,
and is then quantized as usual (RN or SR) under that scale.

Rounding: the divisions by 6 and by 6 x bound (1536 = 3 * 2**9, 2688 = 21 * 2**7) are divisions
by D = 3 or 21 and a power of two. :func:`div_exact` gives the IEEE fp32 quotient p / D in fp32
arithmetic (a product by fp32(1 / D), its exact remainder, one correction): p / D is never within
ulp / (2 D) of a rounding midpoint, so the corrected quotient is the correctly rounded one (checked
on every fp32 significand, tests/test_kernels_exact_arithmetic.py). The power of two is then exact while the
quotient is a normal number, which holds for every block of a tensor whose amax lies in
[2**-100, 2**100] (or is 0); a tensor outside (or a program of per-token rows one of which is)
takes the fp64 divisions, rounded once to fp32, in a uniform branch. The two places where the
compiler could contract a product into the next addition (an FMA rounds once where the spec rounds
twice) pass the product through a max with 0 first.
"""

import functools
from typing import Optional

import triton
import triton.language as tl

from ..spec import FourOverSix, FourOverSixError
from .rounding import e2m1_value, scale_and_encode
from .runtime import INTERPRETED
from .tiles import abs_max16

# fp32(1 / 3) and fp32(1 / 21)
RCP3 = tl.constexpr(0.3333333432674408)
RCP21 = tl.constexpr(0.0476190485060215)


# A copy's 4/6 constexprs, each led by the copy's prefix ("ROW_", "COL_") in the pair kernels.
FOUR_OVER_SIX_CONSTEXPRS = (
    "FOUR_OVER_SIX_E4M3_MAX", "FOUR_OVER_SIX_MSE", "FOUR_OVER_SIX_FAST_MATH")


def four_over_six_names(*prefixes: str) -> list:
    """The names of the 4/6 constexprs of the copies with these prefixes (autotuner keys)."""
    return [prefix + name for prefix in prefixes for name in FOUR_OVER_SIX_CONSTEXPRS]


@functools.lru_cache(maxsize=None)
def four_over_six_constexprs(fos: Optional[FourOverSix], prefix: str = "") -> dict:
    """The 4/6 constexprs of a copy quantized with ``fos`` (None: without 4/6), by name
    (:func:`four_over_six_names` of ``prefix``), as keyword arguments of a kernel launch:
    FOUR_OVER_SIX_E4M3_MAX (0 without 4/6, else ``fos.e4m3_max``, 256 or 448), FOUR_OVER_SIX_MSE
    (``fos.error`` is MSE) and FOUR_OVER_SIX_FAST_MATH (``fos.fast_math``). Cached: the same
    dict for the same arguments (callers unpack it, never change it)."""
    values = (0, False, False) if fos is None else (
        fos.e4m3_max, fos.error is FourOverSixError.MSE, fos.fast_math)
    return dict(zip(four_over_six_names(prefix), values))


def lead_tile(*prefixes: str):
    """An autotuner ``lead`` (``runtime.prune_wide_tiles``) for a quantize kernel whose copies'
    4/6 constexprs have these prefixes: with 4/6 on any copy, the (2, 4) tile of 16x16 blocks
    with 4 warps first, which tuning chose for every 4/6 pair and 2d launch of the GPU preset
    model on an H200 (the kernels' first config, a wider tile, ran the 4/6 step 1.3x slower
    untuned)."""
    def lead(config, args) -> bool:
        return (any(args[prefix + "FOUR_OVER_SIX_E4M3_MAX"] for prefix in prefixes)
                and (config.kwargs["BB"], config.kwargs["BC"], config.num_warps) == (2, 4, 4))
    return lead


@triton.jit
def _rounded(p):
    """``p`` (>= 0 or NaN) as its own rounded fp32 value, never contracted into an FMA (a NaN
    becomes 0: only blocks whose scales are NaN either way have one)."""
    return tl.maximum(p, 0.0)


@triton.jit
def _halves(t):
    """(A, B, 2n) -> its even and odd elements along the last axis, (A, B, n) each."""
    return tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 2, 2)))


@triton.jit
def sum16_in_order(e):
    """e[..., 0] + e[..., 1] + ... + e[..., 15] of (A, B, 16) fp32, left to right: (A, B)."""
    t = (e,)
    for level in tl.static_range(4):
        u = ()
        for k in tl.static_range(1 << level):
            even, odd = _halves(t[k])
            u = u + (even, odd)
        t = u
    acc = t[0]  # element j is t[bit reversal of j] (even/odd splits, lowest bit first)
    for j in tl.static_range(1, 16):
        acc = acc + t[((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3)]
    return tl.reshape(acc, (acc.shape[0], acc.shape[1]))


@triton.jit
def _remainder(p, q0, D: tl.constexpr):
    """p - D * q0, exact where it is an fp32 number (as in :func:`div_exact`): one FMA on the
    GPU; the interpreter, whose FMA rounds twice, computes it in fp64 (D * q0 and the difference
    are exact there)."""
    if INTERPRETED:
        return (p.to(tl.float64) - q0.to(tl.float64) * D).to(tl.float32)
    else:
        return tl.fma(q0, -D * 1.0, p)


@triton.jit
def div_exact(p, D: tl.constexpr):
    """The IEEE fp32 quotient p / D (round to nearest even) for D = 3 or 21 and fp32 ``p`` with a
    normal quotient: q0 = p * fp32(1 / D), its remainder r = p - D * q0 (exact), then
    q0 + r * fp32(1 / D). Inf or NaN ``p`` gives NaN."""
    if D == 3:
        rcp: tl.constexpr = RCP3
    else:
        rcp: tl.constexpr = RCP21
    q0 = p * rcp
    return q0 + _remainder(p, q0, D) * rcp


@triton.jit
def in_range(amax, like):
    """Whether every amax (a scalar or a tensor broadcasting against ``like``) is 0 or in
    [2**-100, 2**100], where the fp32 divisions of :func:`div_exact` give the fp64 path's bits: a
    scalar, the same in every thread."""
    ok = ((amax >= 7.888609052210118e-31) & (amax <= 1.2676506002282294e30)) | (amax == 0.0)
    return tl.min((tl.zeros_like(like) + ok.to(tl.float32)).to(tl.int32)) == 1


@triton.jit
def _bound_quotient(p, E4M3_MAX: tl.constexpr, FP32_DIV: tl.constexpr):
    """p / (6 * E4M3_MAX) in fp32 (the E4M3 bound, 256 or 448): :func:`div_exact` and an exact
    power of two when FP32_DIV, else the fp64 division rounded once."""
    if FP32_DIV:
        if E4M3_MAX == 256:
            return div_exact(p, 3) * 0.001953125  # 1536 = 3 * 2**9
        else:
            return div_exact(p, 21) * 0.0078125  # 2688 = 21 * 2**7
    else:
        return (p.to(tl.float64) / (6.0 * E4M3_MAX)).to(tl.float32)


@triton.jit
def candidate_error(y, enc, sf, s_enc, amax, E4M3_MAX: tl.constexpr, MSE: tl.constexpr,
                    FAST_MATH: tl.constexpr, FP32_DIV: tl.constexpr):
    """The RN error of one candidate for fp32 blocks ``y`` (A, B, 16) with E4M3 scale values
    ``sf`` and encode scales ``enc`` (A, B); ``s_enc`` and ``amax`` broadcast against (A, B).
    Per element, with q the E2M1 value of |y| * enc: ``q * sf * amax / (6 * E4M3_MAX) - |y|``
    (FAST_MATH: ``q * sf - |y| * S_enc``), absolute or (MSE) squared, summed in element order
    (the signed difference of the spec has the same magnitude). FP32_DIV: the divisions in fp32
    (:func:`in_range` holds). Returns (A, B) fp32."""
    a = tl.abs(y)
    val = e2m1_value(a * enc[:, :, None]) * sf[:, :, None]  # exact
    if FAST_MATH:
        d = val - _rounded(a * (tl.zeros_like(enc) + s_enc)[:, :, None])
    else:
        d = _bound_quotient(val * (tl.zeros_like(enc) + amax)[:, :, None], E4M3_MAX, FP32_DIV) - a
    if MSE:
        e = _rounded(d * d)
    else:
        e = tl.abs(d)
    return sum16_in_order(e)


@triton.jit
def candidates(bamax, s_enc, s_dec, FP32_DIV: tl.constexpr):
    """Both candidates of blocks with fp32 amax ``bamax``: ``base = (bamax / 6) * S_enc``, map to
    4 ``scale_and_encode(base * 1.5)`` and map to 6 ``scale_and_encode(base)``, 3 tensors each.
    FP32_DIV (:func:`in_range` holds): bamax / 6 as ``div_exact(bamax, 3) / 2``, which differs from
    the fp64 quotient only where bamax / 6 is an fp32 subnormal; base then stays below 2**-15,
    and both candidates' scales are 0 either way."""
    if FP32_DIV:
        sixth = div_exact(bamax, 3) * 0.5
    else:
        sixth = (bamax.to(tl.float64) / 6.0).to(tl.float32)
    base = sixth * s_enc
    c4, v4, e4 = scale_and_encode(base * 1.5, s_dec)
    c6, v6, e6 = scale_and_encode(base, s_dec)
    return c4, v4, e4, c6, v6, e6


@triton.jit
def pick(map4, c4, v4, e4, c6, v6, e6):
    """(code, value, encode scale) of map to 4 where ``map4``, else of map to 6."""
    return tl.where(map4, c4, c6), tl.where(map4, v4, v6), tl.where(map4, e4, e6)


@triton.jit
def _block_scales(y, bamax, s_enc, s_dec, amax, E4M3_MAX: tl.constexpr, MSE: tl.constexpr,
                  FAST_MATH: tl.constexpr, FP32_DIV: tl.constexpr):
    c4, v4, e4, c6, v6, e6 = candidates(bamax, s_enc, s_dec, FP32_DIV)
    map4 = (candidate_error(y, e4, v4, s_enc, amax, E4M3_MAX, MSE, FAST_MATH, FP32_DIV)
            < candidate_error(y, e6, v6, s_enc, amax, E4M3_MAX, MSE, FAST_MATH, FP32_DIV))
    return pick(map4, c4, v4, e4, c6, v6, e6)


@triton.jit
def four_over_six_scale(y, s_enc, s_dec, amax, E4M3_MAX: tl.constexpr, MSE: tl.constexpr,
                        FAST_MATH: tl.constexpr):
    """4/6 block scales of fp32 1d blocks ``y`` (A, B, 16): (E4M3 code as int32, its fp32 value,
    the fp32 encode scale), each (A, B), as ``rounding.block_scale`` returns them; map to 4 where
    its error is strictly smaller (ties keep map to 6). E4M3_MAX, MSE, FAST_MATH: the copy's
    4/6 settings (:func:`four_over_six_constexprs`). The fp32 divisions where the amaxes allow
    (:func:`in_range`, a uniform branch), else fp64."""
    bamax = abs_max16(y)
    if in_range(amax, bamax):
        code, value, enc = _block_scales(y, bamax, s_enc, s_dec, amax, E4M3_MAX, MSE, FAST_MATH,
                                         True)
    else:
        code, value, enc = _block_scales(y, bamax, s_enc, s_dec, amax, E4M3_MAX, MSE, FAST_MATH,
                                         False)
    return code, value, enc


@triton.jit
def tile_sum(err, BB: tl.constexpr, BC: tl.constexpr):
    """(16 BB, BC) row errors -> (BB, BC) sums over each tile's 16 rows in TE's tree order (rows i
    and i + 8, then i and i + 4, i + 2, i + 1: ``_sum_4over6_2d_error``)."""
    r = tl.reshape(err, (BB, 16, BC))
    for level in tl.static_range(4):
        r = tl.reshape(r, (BB, 2, 8 >> level, BC))
        lo, hi = tl.split(tl.permute(r, (0, 2, 3, 1)))
        r = lo + hi
    return tl.reshape(r, (BB, BC))

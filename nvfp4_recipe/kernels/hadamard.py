"""The 16-point random Hadamard transform of (A, B, 16) blocks along their register axis (item 7).

A fixed 4-stage fp32 butterfly in the reference's order (``reference.rht``), so every backend gets
the same bits (Tseng et al., QuIP#, 2024; NVIDIA, arXiv 2509.25149, section 4.2).
"""

import triton
import triton.language as tl

from .tiles import max_nan

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
    return tl.reduce(tl.abs(a) + tl.abs(b), 2, max_nan)


@triton.jit
def rht16(y, signs):
    """16-point random Hadamard transform of (A, B, 16) blocks along the last axis (spec item 7):
    :func:`hadamard16` times 0.25, fp32 (round it to the input dtype with :func:`round_to`)."""
    return hadamard16(y, signs) * 0.25

"""The NVFP4 numerics spec in plain PyTorch: readable, exact, slow.

Every backend (the Triton kernels, the native Blackwell GEMM) must reproduce these functions; the
tests compare them bit for bit where ``docs/numerics.md`` says so. The items referred to below are the
numbered items of that spec. Works on any device PyTorch runs on.

Tensor conventions: an operand is (..., M, K) with its 16-element blocks along the last dimension K
(the GEMM reduction dimension). 2D blocks are 16x16 tiles of a 2D (M, K) tensor.
"""

from typing import Optional, Union

import torch

from .operand import NVFP4Operand
from .spec import Block, FourOverSix, FourOverSixError, Form, QuantSpec, Scaling
from .formats import (BLOCK, E2M1_MAX, E4M3_MAX, FLT_MAX, e2m1_decode, e2m1_encode_rn,
                      e2m1_floor_code, pack_nibbles, unpack_nibbles)

IntOrTensor = Union[int, torch.Tensor]

# ----------------------------------------------------------------------------------------------
# Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), written
# with the constants and round order of triton.language.random so that it yields the same bits as
# tl.randint4x(seed, offset) for a uint32 offset.
# ----------------------------------------------------------------------------------------------
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_U32 = 0xFFFFFFFF


def _umulhi_lo(a: torch.Tensor, b: int):
    """High and low 32-bit words of a * b for uint32 values held in int64 (no 64-bit overflow)."""
    hi = (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16
    return hi, (a * b) & _U32


def philox4x32(seed: IntOrTensor, counter: torch.Tensor, rounds: int = 10):
    """Philox-4x32 of counter (counter, 0, 0, 0) under the 64-bit key ``seed``.

    Args:
        seed: int in [0, 2**63) or 0-d int64 tensor; key = (seed & 0xFFFFFFFF, seed >> 32).
        counter: int64 tensor of uint32 values (any shape).
    Returns:
        Four int64 tensors shaped like ``counter`` holding uint32 words, equal to Triton's
        ``tl.randint4x(seed, counter)`` (``tl.randint`` is the first word).
    """
    c0 = counter.to(torch.int64) & _U32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    seed = torch.as_tensor(seed, dtype=torch.int64, device=c0.device)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(rounds):
        hi_b, lo_b = _umulhi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _umulhi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _U32
        k1 = (k1 + _PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def sr_bits(seed: IntOrTensor, offset: IntOrTensor, shape, device=None) -> torch.Tensor:
    """8 uniform random bits per element for stochastic rounding (spec item 6).

    Element i (row-major linear index in ``shape``) takes byte ``i % 4`` (0 = lowest) of word
    ``(i % 16) // 4`` of ``tl.randint4x(seed, offset + i // 16)``: one Philox call serves 16
    elements and one 32-bit word 4 consecutive ones, element j of the 4 taking bits [8j, 8j + 8),
    the layout Blackwell's ``cvt.rs.satfinite.e2m1x4.f32`` takes its random word in.

    Returns:
        int64 tensor of ``shape`` with values in [0, 256).
    Raises:
        ValueError: the number of elements is not a multiple of 16.
    """
    n = 1
    for s in shape:
        n *= s
    if n % BLOCK:
        raise ValueError(f"stochastic rounding needs a multiple of {BLOCK} elements, got {n}")
    offset = torch.as_tensor(offset, dtype=torch.int64, device=device)
    counter = offset + torch.arange(n // BLOCK, dtype=torch.int64, device=device)
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # (n/16, 4)
    return torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).reshape(shape)


# ----------------------------------------------------------------------------------------------
# Random Hadamard transform (spec item 7)
# ----------------------------------------------------------------------------------------------
def hadamard16(device=None) -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries +-1), float32."""
    h = torch.ones(1, 1, device=device)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# The RHT signs TransformerEngine and torchao use (TE's ``get_wgrad_sign_vector``): one vector shared
# by every layer, as in NVIDIA's recipe (arXiv 2509.25149).
DEFAULT_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Random Hadamard transform on blocks of 16 along the last dimension (spec item 7).

    ``y_block = x_block @ diag(signs) @ H16 / 4`` (orthogonal): the signs flip the inputs, then a
    fixed 4-stage fp32 butterfly (pair distance 1, 2, 4, 8; ``(a, b) -> (a + b, a - b)``) applies
    H16, then the exact scaling by 1/4, so that every backend gets the same bits; the result is
    rounded to the input dtype (bf16 for bf16 inputs), as TransformerEngine and torchao do before
    the amax and the quantization of the transformed operand. The signs go before H16 on
    purpose: signs applied after it would only flip output signs, which NVFP4 quantization
    (sign-symmetric) and the wgrad product (both operands flipped alike) cancel.
    Source: Tseng et al., QuIP# (2024); NVIDIA's NVFP4 recipe (arXiv 2509.25149, section 4.2);
    TE's ``NVFP4QuantizerRef._apply_rht``.

    Args:
        x: (..., K) bfloat16/float16/float32 tensor, K a multiple of 16.
        signs: (16,) tensor of +-1.
    Returns:
        tensor of the shape and dtype of ``x``.
    """
    _check_last_dim(x)
    return (_signed_butterfly(x, signs) * 0.25).reshape(x.shape).to(x.dtype)


def _signed_butterfly(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``(x_group * signs) @ H_n`` in fp32 for the groups of n = len(signs) elements along the
    last dimension of ``x`` (H_n the Sylvester Hadamard matrix, entries +-1): the fixed butterfly
    of log2(n) stages, pair distance 1, 2, ..., n/2, ``(a, b) -> (a + b, a - b)``. Returns the
    (groups, n) float32 result."""
    n = signs.shape[0]
    y = x.float().reshape(-1, n) * signs.to(device=x.device, dtype=torch.float32)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        h *= 2
    return y


# ----------------------------------------------------------------------------------------------
# Quantization (spec items 1-5, 8-10)
# ----------------------------------------------------------------------------------------------
def _check_last_dim(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")


def check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    """Validate a high-precision tensor for quantization under ``spec``.

    Raises:
        TypeError: dtype not bfloat16, float16 or float32.
        ValueError: a dimension not a multiple of 16, or 2d blocks on a tensor that is not 2-D.
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"NVFP4 quantization takes bfloat16, float16 or float32 input, got {x.dtype}")
    _check_last_dim(x)
    if spec.block is Block.D2 and (x.dim() != 2 or x.shape[0] % BLOCK):
        raise ValueError(f"2d (16x16) blocks need a 2-D tensor with both dims multiples of 16, "
                         f"got shape {tuple(x.shape)}")


def amax(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """max |x| as float32: a scalar (per tensor) or one per row, shape (..., M) (per token).

    NaN and Inf propagate (spec item 9); a tensor (row) without elements has amax 0.
    """
    per_token = scaling == Scaling.PER_TOKEN  # a str enum: "per_token" is accepted too
    if x.numel() == 0:
        return torch.zeros(x.shape[:-1] if per_token else (), dtype=torch.float32, device=x.device)
    a = x.float().abs()
    return a.amax(dim=-1) if per_token else a.amax()


def encode_scale(amax_: torch.Tensor, e4m3_max: float = E4M3_MAX) -> torch.Tensor:
    """The outer encode scale ``S_enc = min(6 * e4m3_max / amax, FLT_MAX)`` in fp32 (spec item 1:
    2688 / amax; with 4/6 the bound ``e4m3_max`` may be 256, item 11).

    amax 0 gives FLT_MAX (an all-zero tensor or row then quantizes to zeros with finite scales);
    amax Inf gives 0 and NaN gives NaN, so the decode scale 1 / S_enc is non-finite (item 9; TE
    instead maps S_enc = 0 to 1). Source: TE's ``NVFP4QuantizerRef._quantize_blockwise_reference``.
    """
    amax_ = amax_.float()
    # Tensor operands: PyTorch's CUDA kernels divide by a Python scalar as a multiplication by its
    # reciprocal (not IEEE division, so CPU and GPU results would differ); a tensor gets true division.
    return torch.clamp(torch.full_like(amax_, E2M1_MAX * e4m3_max) / amax_, max=FLT_MAX)


def decode_scale(s_enc: torch.Tensor) -> torch.Tensor:
    """The outer decode scale ``S_dec = 1 / S_enc`` (fp32, true division): ``outer_scale``."""
    return torch.ones_like(s_enc) / s_enc


def _block_view(x: torch.Tensor, block: Block) -> torch.Tensor:
    """(…, M, K) -> (…, M, K/16, 16) for 1d, (M/16, K/16, 256) for 2d."""
    if block is Block.D1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    m, k = x.shape
    return x.reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK).transpose(1, 2).reshape(
        m // BLOCK, k // BLOCK, BLOCK * BLOCK)


def _unblock(v: torch.Tensor, shape, block: Block) -> torch.Tensor:
    if block is Block.D1:
        return v.reshape(shape)
    m, k = shape
    return v.reshape(m // BLOCK, k // BLOCK, BLOCK, BLOCK).transpose(1, 2).reshape(m, k)


_ONE_SIXTH = 1.0 / E2M1_MAX  # rounded to fp32 where it multiplies an fp32 tensor, as TE's reciprocal(6)


def block_scales(blocks: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block decode scales of spec item 2 for (..., 16 or 256) blocks, fp32 ``s_enc``
    broadcasting against the block axis: ``e4m3(clamp(min(block_amax * (S_enc * (1/6)),
    FLT_MAX), -448, 448))``, round to nearest even, E4M3 subnormals (down to 2**-9) and zero kept.
    """
    block_amax = blocks.abs().amax(dim=-1)
    s = torch.clamp(block_amax * (s_enc * _ONE_SIXTH), max=FLT_MAX)
    return torch.clamp(s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def value_scales(scale: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """Value encode scales of spec item 3: ``min(1 / (float(scale) * S_dec), FLT_MAX)``, fp32;
    a zero block scale gives FLT_MAX (its values then clamp to +-6 and dequantize to 0)."""
    return torch.clamp(1.0 / (scale.float() * s_dec), max=FLT_MAX)


def _candidate_error(x16: torch.Tensor, scale: torch.Tensor, enc: torch.Tensor,
                     s_enc: torch.Tensor, amax_: torch.Tensor, fos: FourOverSix) -> torch.Tensor:
    """The RN error of one 4/6 candidate over the last axis of fp32 ``x16`` (..., 16), its E4M3
    block scale ``scale`` and value encode scale ``enc`` broadcasting against (...): the E2M1
    values q of ``clamp(x * enc, -6, 6)``, then per element ``q * sf * amax / (6 * e4m3_max) - x``
    (fast math: ``q * sf - x * S_enc``), its absolute value (MAE) or square (MSE), summed in
    element order. Source: TE's ``_quantize_blockwise_4over6_reference``."""
    q = e2m1_decode(e2m1_encode_rn(torch.clamp(x16 * enc[..., None], -E2M1_MAX, E2M1_MAX)))
    val = q * scale.float()[..., None]
    if fos.fast_math:
        # TE decodes q * sf as an fp16 product, which holds it exactly (at most 8 significant bits)
        d = val - x16 * s_enc[..., None]
    else:
        denom = torch.full((), E2M1_MAX * fos.e4m3_max, device=x16.device)  # true division on CUDA
        d = val * amax_[..., None] / denom - x16
    e = d * d if fos.error is FourOverSixError.MSE else d.abs()
    err = e[..., 0]
    for i in range(1, BLOCK):
        err = err + e[..., i]
    return err


def _tile_sum(err: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two long) in a tree order: its halves added elementwise,
    until one is left (16 tile-row errors: rows i and i + 8, then i and i + 4, i + 2, i + 1, TE's
    CUDA warp reduction ``_sum_4over6_2d_error``; also MS-EDEN's correction sums)."""
    while err.shape[-1] > 1:
        half = err.shape[-1] // 2
        err = err[..., :half] + err[..., half:]
    return err[..., 0]


def four_over_six_scales(blocks: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor,
                         amax_: torch.Tensor, fos: FourOverSix, block: Block):
    """4/6 block scales (spec item 11) of (..., 16) 1d blocks or (M/16, K/16, 256) 2d tiles
    (``_block_view``; fp32, rows of 16 in row-major order), with fp32 ``s_enc``, ``s_dec`` and
    ``amax_`` (the amax S_enc comes from) broadcasting against the block axis.

    Both candidates from ``base = (block_amax / 6) * S_enc``: map-to-6 ``e4m3(clamp(base, -448,
    448))`` and map-to-4 ``e4m3(clamp(base * 1.5, -448, 448))``, each with its value encode scale
    ``min(1 / (float(sf) * S_dec), FLT_MAX)``; map-to-4 wins where its RN error
    (:func:`_candidate_error`; a tile's 16 row errors summed by :func:`_tile_sum`) is strictly
    smaller. Source: TE main, ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
    (``NVFP4QuantizerRef._quantize_blockwise_4over6_reference``, PR 2972); arXiv 2512.02010.

    Returns:
        (E4M3 block scales, fp32 value encode scales), each of shape ``blocks.shape[:-1]``.
    """
    base = blocks.abs().amax(dim=-1) / torch.full((), E2M1_MAX, device=blocks.device) * s_enc
    cands = []
    for s in (base * 1.5, base):
        scale = torch.clamp(s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        cands.append((scale, value_scales(scale, s_dec)))
    errs = []
    for scale, enc in cands:
        if block is Block.D2:
            rows = blocks.reshape(*blocks.shape[:-1], BLOCK, BLOCK)
            errs.append(_tile_sum(_candidate_error(rows, scale[..., None], enc[..., None],
                                                   s_enc[..., None], amax_[..., None], fos)))
        else:
            errs.append(_candidate_error(blocks, scale, enc, s_enc, amax_, fos))
    pick4 = errs[0] < errs[1]  # ties (and NaN) keep map-to-6
    (s4, e4), (s6, e6) = cands
    return torch.where(pick4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn), \
        torch.where(pick4, e4, e6)


def round_sr(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of float32 ``v`` to E2M1 codes with 8 random bits per element (item 6).

    TransformerEngine's rule for GPUs without ``cvt.rs`` (``stochastic_round_fp4_e2m1``): with
    ``u = bits / 256`` and ``step(a)`` the E2M1 grid spacing at ``a`` (0.5 below 2, 1 below 4,
    else 2), ``t = |v| + u * step(|v|)`` in fp32 (one rounding: the product is exact), then the
    largest grid value <= t, saturated at 6, with the sign of v (``v < 0``). A value on the grid
    never moves; between neighbours lo < |v| < hi it rounds up with probability
    ``floor(256 f) / 256`` (f = (|v| - lo) / step, up to the fp32 rounding of t), so the
    expectation is biased toward zero by less than ``step / 256``.

    Args:
        v: float32 values (any shape); NaN gives code 0.
        bits: integer tensor of v's shape with values in [0, 256) (:func:`sr_bits`).
    Returns:
        uint8 codes 0-15 of v's shape.
    """
    a = torch.clamp(v.abs(), max=E2M1_MAX)  # |v| >= 6 rounds to 6 either way
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    t = a + bits.to(torch.float32) * (step / 256)
    return e2m1_floor_code(t) | ((v < 0).to(torch.uint8) << 3)


# ----------------------------------------------------------------------------------------------
# MS-EDEN (docs/recipe.md, "MS-EDEN"): Quartet II's unbiased quantizer of the backward's operands
# (arXiv 2601.22813; IST-DASLab/Quartet-II, src/models/quantization/schemes/quartet_2.py)
# ----------------------------------------------------------------------------------------------
# Quartet II's constants: a block's amax maps to 6 / (17/16 * 0.93) ~ 6.07 in E2M1 units
# (``backward_scale_override``; values from 5 up round to 6), and the outer scale maps the tensor's
# amax to 255.99 in E4M3 units, not 448, which leaves the EDEN-corrected scales room to grow
# (``eden_1x16s_fp4_kernel``'s ``scales_max``). Both are fp32 constants where they are used.
MS_EDEN_VAL_MAX = 6.0 / (17 / 16 * 0.93)
MS_EDEN_E4M3_MAX = 255.99
# E2M1 rounding to nearest with ties away from zero (Quartet II's ``rtn_fp4``): a magnitude at or
# above each threshold moves up one code.
_HALF_AWAY_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def rotation_size(length: int, size: int) -> int:
    """The MS-EDEN rotation size along a dimension of ``length`` elements (a multiple of 16):
    ``size`` (a power of two), or where ``length`` is not a multiple of it, the largest power of
    two that divides ``length``."""
    while length % size:
        size //= 2
    return size


def rotation_signs(seed: IntOrTensor, offset: IntOrTensor, size: int, device=None) -> torch.Tensor:
    """The ``size`` (at most 128) +-1 signs of an MS-EDEN rotation from one Philox call: sign i is
    -1 where bit ``i % 32`` of word ``i // 32`` of ``tl.randint4x(seed, offset)`` is set.

    Returns:
        (size,) float32 tensor of +-1.
    """
    counter = torch.as_tensor(offset, dtype=torch.int64, device=device).reshape(1)
    words = torch.stack(philox4x32(seed, counter), dim=-1).reshape(4)
    i = torch.arange(size, device=words.device)
    return (1 - 2 * ((words[i // 32] >> (i % 32)) & 1)).to(torch.float32)


def block_uniforms(seed: IntOrTensor, offset: IntOrTensor, n: int, device=None) -> torch.Tensor:
    """One uniform draw in [0, 1) per block for the stochastic rounding of MS-EDEN's block scales:
    block b (row-major over the operand's blocks) takes the top 24 bits of the first word of
    ``tl.randint4x(seed, offset + b)``, times 2**-24 (exact in fp32). The counters are those
    :func:`sr_bits` gives a block's elements.

    Returns:
        (n,) float32 tensor.
    """
    counter = torch.as_tensor(offset, dtype=torch.int64, device=device) + torch.arange(
        n, dtype=torch.int64, device=device)
    return (philox4x32(seed, counter)[0] >> 8).to(torch.float32) * 2.0**-24


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The random Hadamard rotation of MS-EDEN along the last dimension, in groups of n =
    len(signs) (a power of two dividing it): ``y_group = x_group @ diag(signs) @ H_n / sqrt(n)``,
    the fixed fp32 butterfly of :func:`rht` over n points, then times fp32(1 / sqrt(n)) (exact for
    n = 16 and 64). Kept in fp32, as Quartet II's kernel keeps ``tl.dot``'s result.

    Args:
        x: (..., L) float tensor; signs: (n,) tensor of +-1.
    Returns:
        float32 tensor of the shape of ``x``.
    """
    n = signs.shape[0]
    norm = torch.tensor(n ** -0.5, dtype=torch.float32, device=x.device)
    return (_signed_butterfly(x, signs) * norm).reshape(x.shape)


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 to E4M3, nearest even, saturating at +-448 (the GPU's ``cvt.rn.satfinite``)."""
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _e2m1_encode_half_away(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 ``v`` rounded to nearest, ties away from zero (magnitudes above 6 give
    6); the sign bit is set where ``v > 0`` does not hold (a zero gives code 8, -0), as Quartet
    II's ``rtn_fp4`` multiplies by ``where(x > 0, 1, -1)``."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _HALF_AWAY_THRESHOLDS:
        code += a >= t
    return code | ((~(v > 0)).to(torch.uint8) << 3)


def _e4m3_sr(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 scales ``s`` >= 0 rounded stochastically to E4M3 with uniforms ``u``: ``c =
    e4m3(s)`` (satfinite) and its neighbours by code; ``(down, up)`` = ``(c - 1, c)`` where c > s,
    else ``(c, c + 1)``; up where ``u < (s - down) / (up - down)``, else down (so E = s). A scale
    at 448 stays 448 (its upper neighbour is NaN). Quartet II's ``eden_1x16s_fp4_kernel``."""
    bits = _e4m3(s).view(torch.uint8)
    value = lambda b: b.view(torch.float8_e4m3fn).float()
    curr = value(bits)
    above = curr > s
    up = torch.where(above, curr, value(bits + 1))
    down = torch.where(above, value(bits - 1), curr)
    return torch.where(u < (s - down) / (up - down), up, down).to(torch.float8_e4m3fn)


def ms_eden_round(y: torch.Tensor, size: int, amax_: torch.Tensor, uniforms: torch.Tensor):
    """MS-EDEN's rounding of a rotated operand (docs/recipe.md), in fp32 and in the order of Quartet
    II's ``eden_1x16s_fp4_kernel`` (``quartet_2.py``), given its amax and uniforms:

    - outer: ``S_dec = amax / 255.99 / v_max`` (1 where amax == 0), ``v_max = 6 / (17/16 * 0.93)``;
    - block: ``sf = e4m3(block_amax / v_max / S_dec)`` (1 where it is 0), values ``q =
      RTN(y / (sf * S_dec))`` (ties away from zero, :func:`_e2m1_encode_half_away`);
    - EDEN correction per rotation group of ``size`` elements, with ``v = y / (sf * S_dec)``:
      ``sum v*v / sum v*q`` (1 where the denominator is 0), each sum in the pairwise order of
      :func:`_tile_sum` (the reference's ``tl.sum`` leaves it open);
    - each block scale ``sf * correction`` rounded stochastically to a neighbouring E4M3 value
      (:func:`_e4m3_sr`), so that ``q * scale * S_dec`` is the EDEN estimate in expectation.

    Args:
        y: (..., L) float32, L a multiple of ``size``; size: the rotation group (16 to 128).
        amax_: fp32 0-d amax of ``y``; uniforms: fp32 (y.numel() // 16,), one per block.
    Returns:
        (codes uint8 (..., L), E4M3 block scales (..., L // 16), fp32 0-d S_dec).
    """
    dev, n = y.device, y.shape[-1]
    one = torch.ones((), device=dev)
    v_max, e4m3_max = (torch.tensor(c, dtype=torch.float32, device=dev)
                       for c in (MS_EDEN_VAL_MAX, MS_EDEN_E4M3_MAX))
    s_dec = torch.where(amax_ == 0, one, amax_ / e4m3_max / v_max)
    blocks = y.reshape(*y.shape[:-1], n // BLOCK, BLOCK)
    sf = _e4m3(blocks.abs().amax(dim=-1) / v_max / s_dec).float()
    sf = torch.where(sf == 0, one, sf)
    v = blocks / (sf * s_dec)[..., None]
    codes = _e2m1_encode_half_away(v)
    q = e2m1_decode(codes)
    groups = lambda t: t.reshape(*y.shape[:-1], n // size, size)
    num, den = _tile_sum(groups(v * v)), _tile_sum(groups(v * q))
    correction = torch.where(den == 0, one, num / den)
    corrected = sf.reshape(*y.shape[:-1], n // size, size // BLOCK) * correction[..., None]
    scale = _e4m3_sr(corrected.reshape(sf.shape), uniforms.reshape(sf.shape))
    return codes.reshape(y.shape), scale, s_dec


def _ms_eden_rotated(x: torch.Tensor, spec: QuantSpec, signs: Optional[torch.Tensor]):
    """(rotation size along x's last dimension, x rotated by the first that many ``signs``)."""
    full = spec.ms_eden.rotation
    if signs is None or tuple(signs.shape) != (full,):
        raise ValueError(f"an MS-EDEN operand needs the {full} signs of its rotation, got "
                         f"{None if signs is None else tuple(signs.shape)}")
    size = rotation_size(x.shape[-1], full)
    return size, hadamard_rotate(x, signs[:size])


def _quantize_ms_eden(x: torch.Tensor, spec: QuantSpec, seed: IntOrTensor, offset: IntOrTensor,
                      signs: Optional[torch.Tensor], amax_: Optional[torch.Tensor]) -> NVFP4Operand:
    """:func:`quantize` of an MS-EDEN operand (:func:`ms_eden_round` of the rotated x)."""
    size, y = _ms_eden_rotated(x, spec, signs)
    amax_ = amax(y, Scaling.PER_TENSOR) if amax_ is None else amax_.float()
    u = block_uniforms(seed, offset, y.numel() // BLOCK, y.device)
    codes, scale, s_dec = ms_eden_round(y, size, amax_, u)
    return NVFP4Operand(pack_nibbles(codes), scale, s_dec, spec)


def quantize(x: torch.Tensor, spec: QuantSpec = QuantSpec(), *, seed: IntOrTensor = 0,
             offset: IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None,
             amax_: Optional[torch.Tensor] = None) -> NVFP4Operand:
    """Quantize a high-precision tensor to NVFP4 with TransformerEngine's chain (spec items 1-11),
    or with Quartet II's MS-EDEN (docs/recipe.md): :func:`ms_eden_round` of the rotated x.

    In fp32 and in this order: ``S_enc = min(2688 / amax, FLT_MAX)``, ``S_dec = 1 / S_enc``;
    block scale ``sf = e4m3(clamp(min(block_amax * (S_enc * (1/6)), FLT_MAX), -448, 448))``;
    values ``clamp(x * min(1 / (float(sf) * S_dec), FLT_MAX), -6, 6)`` rounded to E2M1, nearest
    even (RN) or stochastically (SR, :func:`round_sr`). Source: TE 2.20
    ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` (``NVFP4QuantizerRef``),
    which Blackwell NVFP4 training (TE, torchao main) reproduces bit for bit.

    Args:
        x: (..., M, K) bfloat16/float16/float32 tensor, K (and M for 2d) a multiple of 16.
        spec: block (1d: 1x16 along K; 2d: 16x16 tiles of a 2-D tensor), scaling (per tensor,
            or per token: one outer scale per row, shape (..., M)), rounding (RN or SR), rht
            (quantize ``rht(x, rht_signs)``, rounded to x's dtype, spec item 7) and amax_scale
            (use ``amax_scale * amax(x)`` as the amax, spec item 8) and four_over_six (block
            scales by :func:`four_over_six_scales`, after the RHT if any; with SR the block is
            rounded stochastically under the scale its RN error chose, item 11), or ms_eden (all
            of it MS-EDEN's, on x rotated along K in groups of the rotation size, or of the
            largest power of two that divides K, :func:`rotation_size`).
        seed, offset: the SR stream, see :func:`sr_bits` (MS-EDEN: :func:`block_uniforms`);
            ignored for RN.
        rht_signs: (16,) +-1 RHT signs, needed when ``spec.rht``; an MS-EDEN operand's
            (``spec.ms_eden.rotation``,) rotation signs (:func:`rotation_signs`).
        amax_: overrides the amax (scalar or (..., M); MS-EDEN: of the rotated x); the backends
            pass the estimate here.
    Returns:
        :class:`NVFP4Operand` (codes) carrying ``spec``, whose ``outer_scale`` is the decode
        scale S_dec.
    Raises:
        TypeError, ValueError: see :func:`check_input`; ValueError for an RHT without signs, an
            MS-EDEN operand without its rotation's.
    """
    check_input(x, spec)
    if spec.ms_eden is not None:
        return _quantize_ms_eden(x, spec, seed, offset, rht_signs, amax_)
    if spec.rht and rht_signs is None:
        raise ValueError("an RHT operand needs rht_signs")
    xf = rht(x, rht_signs).float() if spec.rht else x.float()
    if amax_ is None:
        amax_ = amax(x if spec.amax_scale is not None else xf, spec.scaling)
        if spec.amax_scale is not None:
            amax_ = spec.amax_scale * amax_
    fos = spec.four_over_six
    s_enc = encode_scale(amax_, E4M3_MAX if fos is None else fos.e4m3_max)
    s_dec = decode_scale(s_enc)
    blocks = _block_view(xf, spec.block)
    per_token = (lambda t: t[..., None]) if spec.per_token else (lambda t: t)
    if fos is None:
        scale = block_scales(blocks, per_token(s_enc))
        enc = value_scales(scale, per_token(s_dec))
    else:
        scale, enc = four_over_six_scales(blocks, per_token(s_enc), per_token(s_dec),
                                          per_token(amax_.float()), fos, spec.block)
    v = torch.clamp(blocks * enc[..., None], -E2M1_MAX, E2M1_MAX)
    v = _unblock(v, xf.shape, spec.block)
    if spec.sr:
        codes = round_sr(v, sr_bits(seed, offset, v.shape, device=v.device))
    else:
        codes = e2m1_encode_rn(v)
    return NVFP4Operand(pack_nibbles(codes), scale, s_dec, spec)


def operand_amax(x: torch.Tensor, spec: QuantSpec,
                 rht_signs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 amax :func:`quantize` measures for ``x`` under ``spec`` (a scalar, or (..., M) per
    token): max |RHT(x)| for an RHT operand, max |rotated x| for an MS-EDEN one (``rht_signs``
    its rotation signs), else max |x|; with amax estimation max |x|, which ``quantize`` then
    multiplies by ``spec.amax_scale``. What a caller reduces (a max) across the shards of a tensor
    before quantizing a shard (tensor parallelism).

    Raises:
        TypeError, ValueError: as :func:`quantize`.
    """
    check_input(x, spec)
    if spec.ms_eden is not None:
        return amax(_ms_eden_rotated(x, spec, rht_signs)[1], Scaling.PER_TENSOR)
    if spec.rht and spec.amax_scale is None:
        if rht_signs is None:
            raise ValueError("an RHT operand needs rht_signs")
        return amax(rht(x, rht_signs), spec.scaling)
    return amax(x, spec.scaling)


def expand_scale(scale: torch.Tensor, block: Block) -> torch.Tensor:
    """Block scales as one row per data row, float32: (…, M, K/16); 2d scales repeat 16 times."""
    s = scale.float()
    return s.repeat_interleave(BLOCK, dim=-2) if block == Block.D2 else s  # a str enum: "2d" too


def dequantize_inner(op: NVFP4Operand) -> torch.Tensor:
    """codes * block scale of an operand with codes, float32 (..., M, K), without the outer
    scale. Exact (fits bfloat16 and float16)."""
    v = e2m1_decode(unpack_nibbles(op.qdata))
    s = expand_scale(op.scale, op.block)
    return (v.reshape(*s.shape, BLOCK) * s[..., None]).reshape(v.shape)


def dequantize(op: NVFP4Operand) -> torch.Tensor:
    """Dequantize to float32 (..., M, K): codes * block scale * outer scale (or, for an operand
    holding inner values, values * outer scale)."""
    inner = op.values.float() if op.form is Form.VALUES else dequantize_inner(op)
    outer = op.outer_scale
    return inner * (outer[..., None] if outer.dim() else outer)


def transpose_2d(op: NVFP4Operand) -> NVFP4Operand:
    """The exact transpose of a 2d-quantized (M, K) operand, as a (K, M) operand packed along M.

    Codes and block scales are moved, not requantized: dequantize(transpose) == dequantize(x).T;
    the transpose keeps the operand's spec.

    Raises:
        ValueError: the operand does not have 2d blocks (a 1d operand's blocks would run along
            the wrong dimension; quantize the transpose instead).
    """
    if op.block is not Block.D2:
        raise ValueError("only a 2d-blocked operand has an exact transpose; quantize x.t() instead")
    codes = unpack_nibbles(op.qdata).t().contiguous()
    return NVFP4Operand(pack_nibbles(codes), op.scale.t().contiguous(), op.outer_scale, op.spec)


def scaled_mm(a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Emulated NVFP4 GEMM: D = (s_a[:, None] * s_b[None, :]) * (A_inner @ B_inner^T) + bias.

    A_inner, B_inner are codes times block scales (exact in float32); the product accumulates in
    float32 and the outer scales factor out of the K-sum (spec item 1).

    Args:
        a: operand A, (M, K) with blocks along K; outer scale () or (M,).
        b: operand B, (N, K) with blocks along K; outer scale () or (N,).
        bias: optional (N,) tensor, added in float32.
        out_dtype: dtype of the returned (M, N) tensor.
    Raises:
        ValueError: if the K dimensions differ.
    """
    a_inner = dequantize_inner(a) if a.form is Form.CODES else a.values.float()
    b_inner = dequantize_inner(b) if b.form is Form.CODES else b.values.float()
    if a_inner.shape[-1] != b_inner.shape[-1]:
        raise ValueError(f"K mismatch: A is {tuple(a_inner.shape)}, B is {tuple(b_inner.shape)}")
    return apply_outer_scales(a_inner @ b_inner.t(), a.outer_scale, b.outer_scale, bias, out_dtype)


def apply_outer_scales(acc: torch.Tensor, a_outer: torch.Tensor, b_outer: torch.Tensor,
                       bias: Optional[torch.Tensor] = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GEMM epilogue: ``(s_a[:, None] * s_b[None, :]) * acc + bias`` in fp32, rounded once.

    acc: the float32 (M, N) product of the inner (code x block scale) values; a_outer, b_outer
    the outer scales of A (() or (M,)) and B (() or (N,)).
    """
    s_a = a_outer[:, None] if a_outer.dim() else a_outer
    s_b = b_outer[None, :] if b_outer.dim() else b_outer
    d = (s_a * s_b) * acc
    if bias is not None:
        d = d + bias.float()
    return d.to(out_dtype)

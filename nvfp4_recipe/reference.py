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
    y = (x.float().reshape(-1, BLOCK) * signs.to(device=x.device, dtype=torch.float32))
    h = 1
    while h < BLOCK:
        pairs = y.reshape(-1, BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, BLOCK)
        h *= 2
    return (y * 0.25).reshape(x.shape).to(x.dtype)


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
    """Sum over the last axis of 16 tile-row errors in TE's tree order (its CUDA warp reduction,
    ``_sum_4over6_2d_error``): rows i and i + 8, then i and i + 4, i + 2, i + 1."""
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


def quantize(x: torch.Tensor, spec: QuantSpec = QuantSpec(), *, seed: IntOrTensor = 0,
             offset: IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None,
             amax_: Optional[torch.Tensor] = None) -> NVFP4Operand:
    """Quantize a high-precision tensor to NVFP4 with TransformerEngine's chain (spec items 1-11).

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
            rounded stochastically under the scale its RN error chose, item 11).
        seed, offset: the SR stream, see :func:`sr_bits`; ignored for RN.
        rht_signs: (16,) +-1 RHT signs, needed when ``spec.rht``.
        amax_: overrides the amax (scalar or (..., M)); the backends pass the estimate here.
    Returns:
        :class:`NVFP4Operand` (codes) carrying ``spec``, whose ``outer_scale`` is the decode
        scale S_dec.
    Raises:
        TypeError, ValueError: see :func:`check_input`; ValueError for an RHT without signs.
    """
    check_input(x, spec)
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
    token): max |RHT(x)| for an RHT operand, else max |x|; with amax estimation max |x|, which
    ``quantize`` then multiplies by ``spec.amax_scale``. What a caller reduces (a max) across the
    shards of a tensor before quantizing a shard (tensor parallelism).

    Raises:
        TypeError, ValueError: as :func:`quantize`.
    """
    check_input(x, spec)
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

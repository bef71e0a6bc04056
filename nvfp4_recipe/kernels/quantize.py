"""NVFP4 quantization kernels: the fused 1D rowwise/columnwise kernel and the 2D (16x16) kernel.

Bit-exact with ``nvfp4_recipe.reference.quantize`` (TransformerEngine's chain, docs/numerics.md); the
rounding, Philox, Hadamard and tile helpers they use live in ``rounding``, ``philox``, ``hadamard`` and
``tiles``.

``quantize_1d`` reads an (M, K) matrix once and writes, as asked, its rowwise copy (blocks of 16
along K) and its columnwise copy (the quantization of x^T: blocks of 16 along M, optionally through
the 16-point RHT along M), each with RN or SR and a per-tensor or per-token outer scale. The outer
scales need the amax first, so a call is an amax pass (``amax.amax``, one read covering both copies)
then the quantize pass. Seeds and SR offsets may be device scalars (CUDA-graph friendly); nothing
here synchronises with the host.

A program works on a 2D tile of x with Triton block operations: its rowwise blocks are a
(rows, blocks, 16) tensor (``tiles.load_row_blocks``: two 16-byte loads per block joined in
registers), its columnwise blocks a (columns, blocks, 16) tensor read separately with lanes along
the contiguous axis (``tiles.load_col_blocks``: the second read of each line hits L1/L2), so a
block's 16 elements sit in one thread for the amax, the RHT butterfly, the rounding and the nibble
packing; Triton picks the lanes and converts layouts before the stores. Calls with a columnwise
copy use ``_quantize_1d_kernel`` (one tile per program, optionally with a share of another
operand's dequantize pass riding along: NVFP4Linear's X^T in the dY pass); rowwise-only calls use
``_quantize_rows_kernel`` (T tiles per program along K, the next tile loaded while the current
one is quantized), which measured faster for them and slower for the pairs.
"""

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..operand import NVFP4Operand
from ..spec import Block, Form, QuantSpec
from . import amax as A
from .dequantize import check_codes, dequant_job, load_codes_tile, store_inner_tile
from .four_over_six import (candidate_error, candidates, four_over_six_constexprs,
                            four_over_six_names, four_over_six_scale, in_range, lead_tile, pick,
                            tile_sum)
from .hadamard import rht16
from .philox import bits16
from .rounding import (RN_OFFSET, SR_OFFSET, block_scale, e2m1_rn, e2m1_sr, e2m1_value, outer_scales,
                       round_to)
from .runtime import (Launcher, autotune, cdiv, empty, inner_values_supported, interpreting,
                      prune_wide_tiles, scalar, scalar_arg)
from .tiles import abs_max16, abs_max16_bits, bits_to_float, load_col_blocks, load_row_blocks, pack16

IntOrTensor = Union[int, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Block quantization: (A, B, 16) fp32 blocks along the register axis -> packed codes or inner values
# ----------------------------------------------------------------------------------------------
@triton.jit
def sign_bits(v):
    """The sign bits of fp32 ``v`` + 0 as uint32 0 or 1: v < 0 for every non-NaN v, -0.0 giving +0
    as ``formats.e2m1_encode_rn`` takes it (adding +0 turns -0.0 into +0.0, and folds into the FMA
    that makes v). A NaN's bit is its own: callers zero or mask NaN blocks."""
    return (v + 0.0).to(tl.uint32, bitcast=True) >> 31


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
    ``dequantize.dequantize_inner`` gives for the codes :func:`encode16` writes (NaN for a NaN
    scale).

    RN: the E2M1 value in one rounding (``rounding.e2m1_value``) times the scale, exact in fp32,
    with v's sign bit (:func:`sign_bits`), converted to fp16 (exact: 0 or 2**-10 ... 2688, at
    most 6 significant bits). SR: a code (s e1 e0 m) becomes the E4M3 byte (s 0 0 e1 e0 m 0 0),
    worth value * 2**-6, which the conversion to fp16 (hardware on sm89+) and one fp16 multiply
    by scale * 64 finish, exactly; the code offsets times 4 vanish mod 256.
    """
    if SR:
        mul4 = mul16 // 4
        c, s = nibbles(v, bits, SR)
        e4m3 = (c * mul4 + s * (mul4 * 32)).to(tl.uint8)
        return (e4m3.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                * (scale * 64.0).to(tl.float16)[:, :, None])
    else:
        q = e2m1_value(tl.abs(v)) * scale[:, :, None]
        signed = q.to(tl.uint32, bitcast=True) | (sign_bits(v) << 31)
        return signed.to(tl.float32, bitcast=True).to(tl.float16)


@triton.jit
def quantize_block(y, s_enc6, s_dec, amax, seed, counter, mul16, SR: tl.constexpr,
                   INNER: tl.constexpr, FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                   FOUR_OVER_SIX_MSE: tl.constexpr, FOUR_OVER_SIX_FAST_MATH: tl.constexpr):
    """Quantize fp32 (A, B, 16) blocks along the last axis (spec items 2-6, 11).

    s_enc6, s_dec, amax: S_enc * (1/6) (S_enc with 4/6), S_dec and the amax they come from
    (:func:`outer_scales`), broadcasting against (A, B).
    counter: (A, B) uint32 Philox counter of each block (SR only).
    FOUR_OVER_SIX_*: the 4/6 settings (``four_over_six.four_over_six_constexprs``; an E4M3 bound
    of 0: without 4/6).
    Returns ((A, B) uint64 words of the 16 packed codes, (A, B) int32 E4M3 scale codes), or with
    INNER the (A, B, 16) float16 inner values of :func:`inner16` (and the scale codes).
    """
    if FOUR_OVER_SIX_E4M3_MAX:
        scode, scale, enc = four_over_six_scale(y, s_enc6, s_dec, amax, FOUR_OVER_SIX_E4M3_MAX,
                                                FOUR_OVER_SIX_MSE, FOUR_OVER_SIX_FAST_MATH)
    else:
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


def _configs(loop: bool = False, lead: Optional[Tuple[int, int, int]] = None):
    """Autotuning space: (BB, BC) = a tile in 16 x 16 blocks along M and K; T (``loop``) = tiles
    per program along K (the prefetch loop of ``_quantize_rows_kernel``); ``lead``, the (BB, BC,
    num_warps) to put first. The first config of each list measured fastest at the benchmark shapes
    on an H200 (``benchmarks/sweep_quantize.py``); it is the only one without NVFP4_AUTOTUNE=1 where
    it fits K (``runtime.prune_wide_tiles``)."""
    if interpreting():
        return [triton.Config({"BB": 2, "BC": 2, **({"T": 2} if loop else {})}, num_warps=1)]
    if loop:
        space = ((1, 8, 4, 8, None), (2, 8, 4, 4, None), (1, 16, 4, 4, None), (2, 8, 8, 4, None),
                 (1, 8, 2, 8, None), (1, 8, 4, 8, 128))
        return [triton.Config({"BB": bb, "BC": bc, "T": t}, num_warps=nw, maxnreg=r)
                for bb, bc, nw, t, r in space]
    space = [(2, 8, 4), (2, 4, 4), (4, 8, 4), (4, 8, 8)]
    if lead is not None:
        space.insert(0, space.pop(space.index(lead)))
    return [triton.Config({"BB": bb, "BC": bc}, num_warps=nw) for bb, bc, nw in space]


# ----------------------------------------------------------------------------------------------
# 1D kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def u32(x):
    """x as uint32 (wrapping): the SR counters' arithmetic, which wraps as Philox's does."""
    return tl.cast(x, tl.uint32)


@triton.jit
def _scales(amax_ptr, o_ptr, rows, n, amax_scale, PER_TOKEN: tl.constexpr,
            HAS_AMAX_SCALE: tl.constexpr, first_col, first, FOUR_OVER_SIX_E4M3_MAX: tl.constexpr):
    """(S_enc * (1/6), S_dec, amax) of operand rows ``rows`` ((X,), those < n) when PER_TOKEN, as
    (X, 1) tensors, else of the tensor (scalars) (``rounding.outer_scales``); S_dec, the outer
    scale, is written by the programs holding the first column of those rows (``first_col``),
    or by the ``first`` program when per tensor."""
    if PER_TOKEN:
        idx = rows[:, None]
        s_enc6, s_dec, amax = outer_scales(tl.load(amax_ptr + idx, mask=idx < n, other=0.0),
                                           amax_scale, HAS_AMAX_SCALE, FOUR_OVER_SIX_E4M3_MAX)
        if first_col:
            tl.store(o_ptr + idx, s_dec, mask=idx < n)
    else:
        s_enc6, s_dec, amax = outer_scales(tl.load(amax_ptr), amax_scale, HAS_AMAX_SCALE,
                                           FOUR_OVER_SIX_E4M3_MAX)
        if first:
            tl.store(o_ptr, s_dec)
    return s_enc6, s_dec, amax


@triton.jit
def store_inner16(q_ptr, row, blk, n_cols, vals, mask):
    """Store (A, B, 16) fp16 inner values of the blocks at rows ``row`` and block columns ``blk``
    (index tensors broadcasting to (A, B); ``mask`` likewise) of an (n_rows, n_cols) fp16 matrix
    at q_ptr, with int64 offsets."""
    first = row.to(tl.int64) * n_cols + blk * 16
    tl.store(q_ptr + first[:, :, None] + tl.arange(0, 16)[None, None, :], vals,
             mask=mask[:, :, None])


@triton.jit
def quantize_store(y, row, blk, n_rows, n_cols, q_ptr, s_ptr, s_enc6, s_dec, amax, seed, offset,
                   mul16, SR: tl.constexpr, INNER: tl.constexpr,
                   FOUR_OVER_SIX_E4M3_MAX: tl.constexpr, FOUR_OVER_SIX_MSE: tl.constexpr,
                   FOUR_OVER_SIX_FAST_MATH: tl.constexpr):
    """Quantize fp32 (BB, BC, 16) blocks of operand rows ``row`` and block columns ``blk``
    (index tensors broadcasting to (BB, BC)) of an (n_rows, n_cols) operand; store the codes at
    q_ptr (int64 view of the (n_rows, n_cols / 2) bytes) and the scales at s_ptr, or with INNER
    the fp16 inner values at q_ptr ((n_rows, n_cols); s_ptr unused). A block's Philox counter is
    offset + its index in the row-major (n_rows, n_cols / 16) block grid (``reference.sr_bits``)."""
    idx = row * (n_cols // 16) + blk
    out, scode = quantize_block(y, s_enc6, s_dec, amax, seed, u32(offset) + u32(idx), mul16, SR,
                                INNER, FOUR_OVER_SIX_E4M3_MAX, FOUR_OVER_SIX_MSE,
                                FOUR_OVER_SIX_FAST_MATH)
    mask = (row < n_rows) & (blk < n_cols // 16)
    if INNER:
        store_inner16(q_ptr, row, blk, n_cols, out, mask)
    else:
        tl.store(q_ptr + idx, out.to(tl.int64, bitcast=True), mask=mask)
        tl.store(s_ptr + idx, scode.to(tl.uint8), mask=mask)


@triton.jit
def _quantize_copy(y, rows, blk, n_rows, n_cols, q_ptr, s_ptr, o_ptr, amax_ptr, amax_scale,
                   off_arg, signs_ptr, seed, mul16, first_col, first, OFF_PTR: tl.constexpr,
                   PER_TOKEN: tl.constexpr, HAS_AMAX_SCALE: tl.constexpr, RHT: tl.constexpr,
                   SR: tl.constexpr, INNER: tl.constexpr, FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                   FOUR_OVER_SIX_MSE: tl.constexpr, FOUR_OVER_SIX_FAST_MATH: tl.constexpr):
    """One copy of a program's tile in :func:`_quantize_1d_kernel`: the outer scales of operand
    rows ``rows`` (:func:`_scales`), the RHT of the (len(rows), len(blk), 16) blocks ``y`` (in the
    input dtype) rounded back to that dtype if RHT, then :func:`quantize_store` of them into an
    (n_rows, n_cols) operand."""
    s_enc6, s_dec, amax = _scales(amax_ptr, o_ptr, rows, n_rows, amax_scale, PER_TOKEN,
                                  HAS_AMAX_SCALE, first_col, first, FOUR_OVER_SIX_E4M3_MAX)
    if RHT:
        yf = round_to(rht16(y.to(tl.float32), tl.load(signs_ptr + tl.arange(0, 16))), y.dtype)
    else:
        yf = y.to(tl.float32)
    quantize_store(yf, rows[:, None], blk[None, :], n_rows, n_cols, q_ptr, s_ptr, s_enc6, s_dec,
                   amax, seed, scalar_arg(off_arg, OFF_PTR), mul16, SR, INNER,
                   FOUR_OVER_SIX_E4M3_MAX, FOUR_OVER_SIX_MSE, FOUR_OVER_SIX_FAST_MATH)


@autotune(configs=_configs(), key=["M", "K", "ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_HAS_AMAX_SCALE",
                                    "ROW_INNER", "COL_RHT", "COL_SR", "COL_PER_TOKEN",
                                    "COL_HAS_AMAX_SCALE", "COL_INNER",
                                    *four_over_six_names("ROW_", "COL_"), "DEQUANTIZE", "deq_rows",
                                    "deq_row_bytes"],
          prune=prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], lead_tile("ROW_", "COL_")))
@triton.jit
def _quantize_1d_kernel(x_ptr, M, K, stride_m, stride_k, signs_ptr, seed_arg, mul16,
                        rq_ptr, rs_ptr, ro_ptr, ramax_ptr, r_amax_scale, roff_arg,
                        cq_ptr, cs_ptr, co_ptr, camax_ptr, c_amax_scale, coff_arg,
                        deq_q_ptr, deq_s_ptr, deq_out_ptr, deq_rows, deq_row_bytes, deq_stride_q,
                        deq_stride_s, deq_stride_o,
                        ROW: tl.constexpr, ROW_SR: tl.constexpr, ROW_PER_TOKEN: tl.constexpr,
                        ROW_HAS_AMAX_SCALE: tl.constexpr, ROW_INNER: tl.constexpr,
                        COL_RHT: tl.constexpr, COL_SR: tl.constexpr, COL_PER_TOKEN: tl.constexpr,
                        COL_HAS_AMAX_SCALE: tl.constexpr, COL_INNER: tl.constexpr,
                        ROW_FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                        ROW_FOUR_OVER_SIX_MSE: tl.constexpr,
                        ROW_FOUR_OVER_SIX_FAST_MATH: tl.constexpr,
                        COL_FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                        COL_FOUR_OVER_SIX_MSE: tl.constexpr,
                        COL_FOUR_OVER_SIX_FAST_MATH: tl.constexpr,
                        SEED_PTR: tl.constexpr, ROFF_PTR: tl.constexpr, COFF_PTR: tl.constexpr,
                        DEQUANTIZE: tl.constexpr, DEQ_BLOCK_2D: tl.constexpr, DEQ_BR: tl.constexpr,
                        DEQ_H: tl.constexpr, DEQ_EVEN_K: tl.constexpr, DEQ_PTX: tl.constexpr,
                        BB: tl.constexpr, BC: tl.constexpr):
    """The kernel of calls with a columnwise copy (and an optional rowwise one, ROW). One
    (16 BB, 16 BC) tile of x per program. Rowwise: the tile's (16 BB, BC, 16) row blocks;
    columnwise: its (16 BC, BB, 16) column blocks, read again right after (L1/L2 hits).
    With DEQUANTIZE each program then takes every num_programs-th tile of another operand's
    dequantize pass (:func:`ride_dequantize`): memory traffic that overlaps the issue-bound
    arithmetic of the other programs on the SM, where a dequantize kernel on another stream did
    not. Loading the tile early, into registers or L2, measured slower."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    seed = scalar_arg(seed_arg, SEED_PTR)
    first = (pid_b == 0) & (pid_c == 0)
    if ROW:  # operand x (M, K): rows m, block columns c
        m = pid_b * (16 * BB) + tl.arange(0, 16 * BB)
        c = pid_c * BC + tl.arange(0, BC)
        y = load_row_blocks(x_ptr, m, c, M, K, stride_m, stride_k)
        _quantize_copy(y, m, c, M, K, rq_ptr, rs_ptr, ro_ptr, ramax_ptr, r_amax_scale,
                       roff_arg, signs_ptr, seed, mul16, pid_c == 0, first, ROFF_PTR,
                       ROW_PER_TOKEN, ROW_HAS_AMAX_SCALE, False, ROW_SR, ROW_INNER,
                       ROW_FOUR_OVER_SIX_E4M3_MAX, ROW_FOUR_OVER_SIX_MSE,
                       ROW_FOUR_OVER_SIX_FAST_MATH)
    # operand x^T (K, M): rows k, block columns b
    k = pid_c * (16 * BC) + tl.arange(0, 16 * BC)
    b = pid_b * BB + tl.arange(0, BB)
    y = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)
    _quantize_copy(y, k, b, K, M, cq_ptr, cs_ptr, co_ptr, camax_ptr, c_amax_scale, coff_arg,
                   signs_ptr, seed, mul16, pid_b == 0, first, COFF_PTR, COL_PER_TOKEN,
                   COL_HAS_AMAX_SCALE, COL_RHT, COL_SR, COL_INNER, COL_FOUR_OVER_SIX_E4M3_MAX,
                   COL_FOUR_OVER_SIX_MSE, COL_FOUR_OVER_SIX_FAST_MATH)
    if DEQUANTIZE:
        ride_dequantize(deq_q_ptr, deq_s_ptr, deq_out_ptr, deq_rows, deq_row_bytes, deq_stride_q,
                        deq_stride_s, deq_stride_o, DEQ_BLOCK_2D, DEQ_BR, DEQ_H, DEQ_EVEN_K,
                        DEQ_PTX)


@triton.jit
def ride_dequantize(deq_q_ptr, deq_s_ptr, deq_out_ptr, deq_rows, deq_row_bytes, deq_stride_q,
                    deq_stride_s, deq_stride_o, DEQ_BLOCK_2D: tl.constexpr, DEQ_BR: tl.constexpr,
                    DEQ_H: tl.constexpr, DEQ_EVEN_K: tl.constexpr, DEQ_PTX: tl.constexpr):
    """This program's share of another operand's dequantize pass, run at the end of a quantize
    kernel with a 2-D grid: every num_programs-th tile (``dequantize.load_codes_tile``,
    ``store_inner_tile``). The operand has ``deq_rows`` rows of ``deq_row_bytes`` packed bytes
    (K / 2); the arguments and the DEQ_* constexprs are those of ``dequantize.dequant_job``
    (:func:`dequantize_job`)."""
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    for t in range(tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                   tl.cdiv(deq_rows, DEQ_BR) * tl.cdiv(deq_row_bytes, DEQ_H), n_prog):
        q, s = load_codes_tile(deq_q_ptr, deq_s_ptr, deq_rows, deq_row_bytes, deq_stride_q,
                               deq_stride_s, t, DEQ_BLOCK_2D, DEQ_BR, DEQ_H, DEQ_EVEN_K)
        store_inner_tile(q, s, deq_out_ptr, deq_rows, deq_row_bytes, deq_stride_o, t, DEQ_BR,
                         DEQ_H, DEQ_EVEN_K, DEQ_PTX)


@autotune(configs=_configs(loop=True), key=["M", "K", "SR", "PER_TOKEN", "HAS_AMAX_SCALE", "INNER",
                                             "RHT", *four_over_six_names("")],
          prune=prune_wide_tiles(lambda c: 16 * c.kwargs["BC"] * c.kwargs["T"]))
@triton.jit
def _quantize_rows_kernel(x_ptr, M, K, stride_m, stride_k, signs_ptr, seed_arg, mul16, q_ptr,
                          s_ptr, o_ptr, amax_ptr, amax_scale, off_arg, SR: tl.constexpr,
                          PER_TOKEN: tl.constexpr, HAS_AMAX_SCALE: tl.constexpr,
                          INNER: tl.constexpr, RHT: tl.constexpr,
                          FOUR_OVER_SIX_E4M3_MAX: tl.constexpr, FOUR_OVER_SIX_MSE: tl.constexpr,
                          FOUR_OVER_SIX_FAST_MATH: tl.constexpr, SEED_PTR: tl.constexpr,
                          OFF_PTR: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr,
                          T: tl.constexpr):
    """The rowwise-only kernel (calls without a columnwise copy; with one, the loop measured slower
    than :func:`_quantize_1d_kernel`). T tiles of (16 BB, 16 BC) elements of x per program, along
    K, in a loop that loads the next tile's (16 BB, BC, 16) row blocks while it quantizes the
    current one (register double buffering: the loads of a warp overlap its arithmetic). With RHT
    the blocks go through the 16-point RHT along K first, in registers, rounded back to x's dtype
    (item 7)."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    seed = scalar_arg(seed_arg, SEED_PTR)
    off = scalar_arg(off_arg, OFF_PTR)
    m = pid_b * (16 * BB) + tl.arange(0, 16 * BB)  # rows of x
    c = pid_c * (T * BC) + tl.arange(0, BC)  # block columns of x, first tile
    s_enc6, s_dec, amax = _scales(amax_ptr, o_ptr, m, M, amax_scale, PER_TOKEN, HAS_AMAX_SCALE,
                                  pid_c == 0, (pid_b == 0) & (pid_c == 0), FOUR_OVER_SIX_E4M3_MAX)
    signs = tl.load(signs_ptr + tl.arange(0, 16)) if RHT else None
    x = load_row_blocks(x_ptr, m, c, M, K, stride_m, stride_k)
    for t in range(T):
        x_next = load_row_blocks(x_ptr, m, c + BC, M, K, stride_m, stride_k, t + 1 < T)  # prefetch
        y = x.to(tl.float32)
        if RHT:
            y = round_to(rht16(y, signs), x.dtype)
        quantize_store(y, m[:, None], c[None, :], M, K, q_ptr, s_ptr, s_enc6, s_dec, amax, seed,
                       off, mul16, SR, INNER, FOUR_OVER_SIX_E4M3_MAX, FOUR_OVER_SIX_MSE,
                       FOUR_OVER_SIX_FAST_MATH)
        x = x_next
        c += BC


# ----------------------------------------------------------------------------------------------
# 2D kernel
# ----------------------------------------------------------------------------------------------
@autotune(configs=_configs(lead=(4, 8, 4)), key=["N", "K", "W", "WT", "SR", "HAS_AMAX_SCALE",
                                                  "INNER", *four_over_six_names("")],
          prune=prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], lead_tile("")))
@triton.jit
def _quantize_2d_kernel(w_ptr, N, K, stride_n, stride_k, amax_ptr, amax_scale, seed_arg, off_arg,
                        mul16, q_ptr, s_ptr, qt_ptr, st_ptr, o_ptr,
                        W: tl.constexpr, WT: tl.constexpr, SR: tl.constexpr,
                        HAS_AMAX_SCALE: tl.constexpr, INNER: tl.constexpr,
                        FOUR_OVER_SIX_E4M3_MAX: tl.constexpr, FOUR_OVER_SIX_MSE: tl.constexpr,
                        FOUR_OVER_SIX_FAST_MATH: tl.constexpr, SEED_PTR: tl.constexpr,
                        OFF_PTR: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """W (N, K) in 16x16 blocks, a (16 BB, 16 BC) tile per program (:func:`quantize_2d_tile`)."""
    quantize_2d_tile(w_ptr, N, K, stride_n, stride_k, amax_ptr, amax_scale,
                     scalar_arg(seed_arg, SEED_PTR), scalar_arg(off_arg, OFF_PTR), mul16, q_ptr,
                     s_ptr, qt_ptr, st_ptr, o_ptr, tl.program_id(0), tl.program_id(1), W, WT, SR,
                     HAS_AMAX_SCALE, INNER, FOUR_OVER_SIX_E4M3_MAX, FOUR_OVER_SIX_MSE,
                     FOUR_OVER_SIX_FAST_MATH, BB, BC)


@triton.jit
def _row_blocks_of(t, BB: tl.constexpr, BC: tl.constexpr):
    """(BB, BC) values of 16x16 blocks -> (16 BB, BC), one per row of each block."""
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BB, 16, BC)), (16 * BB, BC))


@triton.jit
def _tile_scales(rows, tile_amax, s_enc, s_dec, amax, E4M3_MAX: tl.constexpr, MSE: tl.constexpr,
                 FAST_MATH: tl.constexpr, FP32_DIV: tl.constexpr, BB: tl.constexpr,
                 BC: tl.constexpr):
    c4, v4, e4, c6, v6, e6 = candidates(tile_amax, s_enc, s_dec, FP32_DIV)
    err4 = candidate_error(rows, _row_blocks_of(e4, BB, BC), _row_blocks_of(v4, BB, BC), s_enc,
                           amax, E4M3_MAX, MSE, FAST_MATH, FP32_DIV)
    err6 = candidate_error(rows, _row_blocks_of(e6, BB, BC), _row_blocks_of(v6, BB, BC), s_enc,
                           amax, E4M3_MAX, MSE, FAST_MATH, FP32_DIV)
    return pick(tile_sum(err4, BB, BC) < tile_sum(err6, BB, BC), c4, v4, e4, c6, v6, e6)


@triton.jit
def _four_over_six_tiles(rows, tile_amax, s_enc, s_dec, amax, E4M3_MAX: tl.constexpr,
                         MSE: tl.constexpr, FAST_MATH: tl.constexpr, BB: tl.constexpr,
                         BC: tl.constexpr):
    """4/6 scales of (BB, BC) 16x16 tiles (``four_over_six.four_over_six_scale`` with each
    candidate's error summed over the tile's 16 row blocks ``rows`` (16 BB, BC, 16) fp32, in
    TE's tree order): (code, value, encode scale), each (BB, BC)."""
    if in_range(amax, tile_amax):
        code, value, enc = _tile_scales(rows, tile_amax, s_enc, s_dec, amax, E4M3_MAX, MSE,
                                        FAST_MATH, True, BB, BC)
    else:
        code, value, enc = _tile_scales(rows, tile_amax, s_enc, s_dec, amax, E4M3_MAX, MSE,
                                        FAST_MATH, False, BB, BC)
    return code, value, enc


@triton.jit
def quantize_2d_tile(w_ptr, N, K, stride_n, stride_k, amax_ptr, amax_scale, seed, off, mul16,
                     q_ptr, s_ptr, qt_ptr, st_ptr, o_ptr, pid_b, pid_c,
                     W: tl.constexpr, WT: tl.constexpr, SR: tl.constexpr,
                     HAS_AMAX_SCALE: tl.constexpr, INNER: tl.constexpr,
                     FOUR_OVER_SIX_E4M3_MAX: tl.constexpr, FOUR_OVER_SIX_MSE: tl.constexpr,
                     FOUR_OVER_SIX_FAST_MATH: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """Tile (pid_b, pid_c) of W (N, K) in 16x16 blocks: codes stored packed along the rows (q_ptr:
    int64 view of W's (N, K/2) bytes; with INNER, W's fp16 inner values instead, q_ptr an (N, K)
    float16 matrix, s_ptr unused) and along the columns (qt_ptr: int64 view of W^T's (K, N/2)
    bytes). The tile amaxes come from the row blocks; the W^T codes are computed on the column
    blocks (read again), with the same multipliers and, for SR, W's random bits transposed, so
    they equal the W codes. ``seed`` and ``off``: the SR stream's key and counter base (values)."""
    n = pid_b * (16 * BB) + tl.arange(0, 16 * BB)
    b = pid_b * BB + tl.arange(0, BB)
    c = pid_c * BC + tl.arange(0, BC)
    rows = load_row_blocks(w_ptr, n, c, N, K, stride_n, stride_k)  # [n, c, i] = w[n, 16c + i]
    s_enc6, s_dec, amax = outer_scales(tl.load(amax_ptr), amax_scale, HAS_AMAX_SCALE,
                                       FOUR_OVER_SIX_E4M3_MAX)
    if (pid_b == 0) & (pid_c == 0):
        tl.store(o_ptr, s_dec)
    a16 = abs_max16_bits(rows)
    a = tl.max(tl.reshape(a16, (BB, 16, BC)), axis=1).to(a16.dtype)  # tile amax, input bits
    if FOUR_OVER_SIX_E4M3_MAX:
        scode, scale, enc = _four_over_six_tiles(rows.to(tl.float32), bits_to_float(a, rows.dtype),
                                                 s_enc6, s_dec, amax, FOUR_OVER_SIX_E4M3_MAX,
                                                 FOUR_OVER_SIX_MSE, FOUR_OVER_SIX_FAST_MATH, BB,
                                                 BC)
    else:
        scode, scale, enc = block_scale(bits_to_float(a, rows.dtype), s_enc6, s_dec)  # (BB, BC)
    mask = (b < N // 16)[:, None] & (c < K // 16)[None, :]
    if W and not INNER:
        tl.store(s_ptr + b[:, None] * (K // 16) + c[None, :], scode.to(tl.uint8), mask=mask)
    if WT:
        tl.store(st_ptr + c[None, :] * (N // 16) + b[:, None], scode.to(tl.uint8), mask=mask)
    bits = 0
    if SR:  # W's row-major element order
        counter = u32(off) + u32(n[:, None]) * u32(K // 16) + u32(c[None, :])
        bits = bits16(seed, counter)  # (16 BB, BC, 16)
    if W:
        enc_r = _row_blocks_of(enc, BB, BC)
        v = rows.to(tl.float32) * enc_r[:, :, None]
        rmask = (n < N)[:, None] & (c < K // 16)[None, :]
        if INNER:
            store_inner16(q_ptr, n[:, None], c[None, :], K,
                          inner16(v, bits, _row_blocks_of(scale, BB, BC), mul16, SR), rmask)
        else:
            words = encode16(v, bits, enc_r != enc_r, mul16, SR)
            tl.store(q_ptr + n[:, None] * (K // 16) + c[None, :], words.to(tl.int64, bitcast=True),
                     mask=rmask)
    if WT:
        k = pid_c * (16 * BC) + tl.arange(0, 16 * BC)
        cols = load_col_blocks(w_ptr, k, b, N, K, stride_n, stride_k)  # [k, b, j] = w[16b + j, k]
        et = tl.trans(enc)  # (BC, BB)
        enc_c = _row_blocks_of(et, BC, BB)
        bits_c = 0
        if SR:
            bits_c = tl.reshape(tl.trans(tl.reshape(bits, (16 * BB, 16 * BC))), (16 * BC, BB, 16))
        words = encode16(cols.to(tl.float32) * enc_c[:, :, None], bits_c, enc_c != enc_c, mul16, SR)
        cmask = (k < K)[:, None] & (b < N // 16)[None, :]
        tl.store(qt_ptr + k[:, None] * (N // 16) + b[None, :], words.to(tl.int64, bitcast=True),
                 mask=cmask)


_PAIR, _ROWS, _2D = Launcher(_quantize_1d_kernel), Launcher(_quantize_rows_kernel), Launcher(_quantize_2d_kernel)


# ----------------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------------
def empty_copy(rows: int, cols: int, spec: QuantSpec, inner: bool, outer_shape: Tuple[int, ...],
               device) -> NVFP4Operand:
    """The empty output of a 1d copy of ``rows`` rows and ``cols`` columns quantized under
    ``spec``: codes and scales (the scales as uint8 until the kernel has written them,
    :func:`scales_as_e4m3`) or, with ``inner``, float16 inner values; an fp32 outer scale of
    ``outer_shape``."""
    outer = empty(outer_shape, torch.float32, device)
    if inner:
        return NVFP4Operand(None, None, outer, spec,
                            torch.empty(rows, cols, dtype=torch.float16, device=device))
    return NVFP4Operand(torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),
                        torch.empty(rows, cols // 16, dtype=torch.uint8, device=device), outer,
                        spec)


def output_pointers(q: NVFP4Operand) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_ptr, s_ptr) arguments of :func:`quantize_store` for an output."""
    if q.form is Form.VALUES:
        return q.values, q.values
    return q.qdata.view(torch.int64), q.scale


def scales_as_e4m3(q: NVFP4Operand) -> NVFP4Operand:
    """A written output with its block scales viewed as float8_e4m3fn (the kernels store the
    E4M3 codes into uint8)."""
    return q if q.scale is None else q._replace(scale=q.scale.view(torch.float8_e4m3fn))


def _check_1d(spec: Optional[QuantSpec]) -> None:
    if spec is not None and spec.block is not Block.D1:
        raise ValueError(f"quantize_1d makes 1d copies; got {spec.block.value} blocks (quantize_2d)")


def quantize_1d(x: torch.Tensor, row: Optional[QuantSpec] = None, col: Optional[QuantSpec] = None,
                *, inner: Tuple[bool, bool] = (False, False), seed: IntOrTensor = 0,
                row_offset: IntOrTensor = 0, col_offset: IntOrTensor = 0,
                signs: Optional[torch.Tensor] = None,
                amaxes: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                dequantize: Optional[Tuple[NVFP4Operand, torch.Tensor]] = None,
                ) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand]]:
    """Rowwise and/or columnwise 1D NVFP4 quantization of a matrix from one read (plus the amax pass).

    Args:
        x: (M, K) bfloat16/float16/float32, any strides (a transposed view reads coalesced through
            its columnwise path, see the backend). K must be a multiple of 16; M too for ``col``.
        row: the rowwise copy, blocks along K (``reference.quantize(x, ...)``), or None. One with
            ``rht`` is made by the rowwise-only kernel (the RHT along K on its row blocks), so
            with a columnwise copy too the call reads x twice.
        col: the columnwise copy, the quantization of x^T with blocks along M
            (``reference.quantize(x.t(), ...)``), or None.
        inner: per copy, write its inner values (codes x block scales, float16, exact) instead of
            codes and scales, for a GEMM that uses the copy at once (no dequantize pass).
        seed, row_offset, col_offset: Philox stream of the SR copies (ints or device int64 scalars).
        signs: (16,) +-1 RHT signs (any device; needed when a copy has ``rht``).
        amaxes: the (row, column) fp32 amaxes as :func:`amax_pass` returns them for these specs, to
            skip the amax pass (benchmarks time the two passes apart).
        dequantize: (op, out): another operand with codes (1d or 2d blocks), whose inner values
            (``dequantize.dequantize_inner``, exact) the same launch writes into out ((R, C)
            float16/bfloat16/float32, unit stride along C). Only with a columnwise copy: that pass
            is bound by instruction issue, so the dequantization's memory traffic overlaps its
            arithmetic.
    Returns:
        (rowwise, columnwise) :class:`NVFP4Operand` or None each, carrying ``row`` / ``col`` as
        its spec: qdata (M, K/2) / (K, M/2) uint8,
        scale (M, K/16) / (K, M/16) float8_e4m3fn, outer scale () or (M,) / (K,) fp32; an
        ``inner`` copy has values (M, K) / (K, M) float16 instead of codes and scales.
    Raises:
        TypeError: unsupported dtype. ValueError: shape, a 2d spec, an RHT without signs, an
            ``inner`` copy on a GPU without E4M3 conversion (before sm89), or ``dequantize``
            without a columnwise copy (or with tensors ``check_codes`` refuses, a wrongly shaped
            out, another device).
    Source: spec items 1-11 of docs/numerics.md (reference.py).
    """
    _check_1d(row)
    _check_1d(col)
    A.check_matrix(x, rows16=col is not None, cols16=row is not None)
    if dequantize is not None and col is None:
        raise ValueError("dequantize runs in the pass that writes a columnwise copy; there is none")
    if (row and row.rht or col and col.rht) and signs is None:
        raise ValueError("an RHT copy needs the 16 RHT signs")
    if row is not None and row.rht and col is not None:
        # the RHT along K runs on row blocks, in the rowwise-only kernel: two calls
        r = quantize_1d(x, row, inner=(inner[0], False), seed=seed, row_offset=row_offset,
                        signs=signs, amaxes=None if amaxes is None else (amaxes[0], None))[0]
        c = quantize_1d(x, col=col, inner=(False, inner[1]), seed=seed, col_offset=col_offset,
                        signs=signs, amaxes=None if amaxes is None else (None, amaxes[1]),
                        dequantize=dequantize)[1]
        return r, c
    check_inner(any(inner), x.device)
    m, k = x.shape
    dev = x.device
    rht = bool(row and row.rht or col and col.rht)
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if rht else x
    row_amax, col_amax = amaxes if amaxes is not None else amax_pass(x, row, col, signs_t)
    r = empty_copy(m, k, row, inner[0], (m,) if row.per_token else (), dev) if row else None
    c = empty_copy(k, m, col, inner[1], (k,) if col.per_token else (), dev) if col else None
    seed_a, seed_p = scalar(seed, dev)
    roff_a, roff_p = scalar(row_offset, dev)
    coff_a, coff_p = scalar(col_offset, dev)
    if c is None:  # rowwise only: the prefetch loop kernel (T tiles per program)
        grid = lambda meta: (cdiv(m, 16 * meta["BB"]), cdiv(k, 16 * meta["BC"] * meta["T"]))
        _ROWS[grid](
            x, m, k, x.stride(0), x.stride(1), signs_t, seed_a, 16, *output_pointers(r),
            r.outer_scale, row_amax, float(row.amax_scale or 1.0), roff_a, SR=row.sr,
            PER_TOKEN=row.per_token, HAS_AMAX_SCALE=row.amax_scale is not None, INNER=inner[0],
            RHT=row.rht,
            **four_over_six_constexprs(row.four_over_six), SEED_PTR=seed_p, OFF_PTR=roff_p)
        return scales_as_e4m3(r), None
    dummy = x
    d_args, d_consts = dequantize_job(dequantize, dummy)
    grid = lambda meta: (cdiv(m, 16 * meta["BB"]), cdiv(k, 16 * meta["BC"]))
    _PAIR[grid](
        x, m, k, x.stride(0), x.stride(1), signs_t, seed_a, 16,
        *(output_pointers(r) if r else (dummy, dummy)), r.outer_scale if r else dummy,
        row_amax if r else dummy, float(row.amax_scale or 1.0) if r else 1.0, roff_a,
        *output_pointers(c), c.outer_scale, col_amax, float(col.amax_scale or 1.0), coff_a,
        *d_args, **d_consts,
        ROW=r is not None, ROW_SR=bool(row and row.sr), ROW_PER_TOKEN=bool(row and row.per_token),
        ROW_HAS_AMAX_SCALE=bool(row and row.amax_scale is not None),
        ROW_INNER=bool(row and inner[0]), COL_RHT=col.rht, COL_SR=col.sr,
        COL_PER_TOKEN=col.per_token, COL_HAS_AMAX_SCALE=col.amax_scale is not None,
        COL_INNER=inner[1], **four_over_six_constexprs(row and row.four_over_six, "ROW_"),
        **four_over_six_constexprs(col.four_over_six, "COL_"),
        SEED_PTR=seed_p, ROFF_PTR=roff_p, COFF_PTR=coff_p)
    return (scales_as_e4m3(r) if r else None, scales_as_e4m3(c))


def dequantize_job(dequantize, x: torch.Tensor):
    """The dequantize arguments and the DEQUANTIZE and ``DEQ_*`` constexprs of
    :func:`ride_dequantize` for a quantize kernel of x given ``dequantize=(op, out)`` (dummies and
    DEQUANTIZE False for None), checked.

    Raises:
        TypeError: out's dtype, or op's (``dequantize.check_codes``). ValueError: op's layout,
            out's shape or strides, tensors on another device than x.
    """
    if dequantize is None:
        return (x, x, x, 0, 0, 0, 0, 0), dict(DEQUANTIZE=False, DEQ_BLOCK_2D=False, DEQ_BR=1,
                                               DEQ_H=1, DEQ_EVEN_K=True, DEQ_PTX=False)
    op, out = dequantize
    op = check_codes("dequantize", op, outer=False)
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dequantize: out must be float16, bfloat16 or float32, got {out.dtype}")
    if tuple(out.shape) != (op.rows, op.k) or (op.k > 1 and out.stride(1) != 1):
        raise ValueError(f"dequantize: out must be ({op.rows}, {op.k}) with unit stride along K, "
                         f"got {tuple(out.shape)} with strides {out.stride()}")
    if op.qdata.device != x.device or out.device != x.device:
        raise ValueError(f"dequantize: its tensors are on {op.qdata.device} and {out.device}, x "
                         f"on {x.device}")
    args, consts, _ = dequant_job(op, out)
    return args, {"DEQUANTIZE": True, **{f"DEQ_{k}": v for k, v in consts.items()}}


def amax_pass(x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec],
              signs: Optional[torch.Tensor] = None):
    """The amaxes (before any amax_scale factor) that :func:`quantize_1d` needs for copies ``row``
    and ``col`` of x, from one pass over x (two when the rowwise copy has an RHT and there is a
    columnwise one): (row amax or None, column amax or None), fp32 device tensors, () or per
    index. An amax is of the RHT output when its copy has ``rht`` and no amax_scale (estimation
    skips that pass)."""
    r_mode, c_mode = A.amax_mode(row), A.amax_mode(col)
    if row and row.rht and row.amax_scale is None:  # the RHT along K: row blocks, a pass of its own
        return (A.amax(x, r_mode, A.NONE, signs=signs, row_rht=True)[0],
                amax_pass(x, None, col, signs)[1] if col else None)
    col_rht = bool(col and col.rht and col.amax_scale is None)
    if c_mode == A.TENSOR and not col_rht and r_mode != A.PER_INDEX:
        a, _ = A.amax(x, A.TENSOR, A.NONE)  # one global amax serves both copies
        return (a if row else None), a
    return A.amax(x, r_mode, c_mode, col_rht, signs if col_rht else None)


def quantize_2d(w: torch.Tensor, spec: QuantSpec = QuantSpec(Block.D2), *, seed: IntOrTensor = 0,
                offset: IntOrTensor = 0, write_w: bool = True, write_wt: bool = True,
                amax: Optional[torch.Tensor] = None, inner: bool = False,
                ) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand]]:
    """2D (16x16 block) NVFP4 quantization of a matrix and its exact transpose from one read.

    Args:
        w: (N, K) bfloat16/float16/float32, any strides, both dimensions multiples of 16.
        spec: a Block.D2, per-tensor spec without RHT; its rounding (SR: Philox stream ``seed``,
            ``offset`` in W's row-major order) and amax_scale (spec item 8) apply.
        write_w, write_wt: which of W and W^T to write.
        amax: max |w| (fp32 device scalar) to skip the amax pass.
        inner: write W as its inner values (codes x block scales, float16, exact) instead of
            codes and scales, for a GEMM that uses W at once (no dequantize pass).
    Returns:
        (W, W^T) :class:`NVFP4Operand` (both carrying ``spec``) or None: qdata (N, K/2) / (K, N/2), scale
        (N/16, K/16) / (K/16, N/16), shared per-tensor outer scale; W^T equals
        ``reference.transpose_2d(W)``. With ``inner``, W has values (N, K) float16 instead.
    Raises:
        TypeError: unsupported dtype. ValueError: shape, a spec that is not 2d / has RHT, or
            ``inner`` on a GPU without E4M3 conversion (before sm89).
    Source: spec items 1-6 and 11 with 2d blocks (reference.quantize(block="2d")).
    """
    if spec.block is not Block.D2 or spec.rht:
        raise ValueError(f"quantize_2d takes a 2d spec without RHT, got {spec}")
    A.check_matrix(w, rows16=True, cols16=True)
    check_inner(inner and write_w, w.device)
    n, k = w.shape
    dev = w.device
    amax_ = amax if amax is not None else A.amax(w, A.TENSOR, A.NONE)[0]
    wq, wtq, outer = empty_2d((), n, k, spec, write_w, write_wt, inner, dev)
    seed_a, seed_p = scalar(seed, dev)
    off_a, off_p = scalar(offset, dev)
    grid = lambda meta: (cdiv(n, 16 * meta["BB"]), cdiv(k, 16 * meta["BC"]))
    _2D[grid](
        w, n, k, w.stride(0), w.stride(1), amax_, float(spec.amax_scale or 1.0), seed_a, off_a, 16,
        *(output_pointers(wq) if wq else (w, w)), *(output_pointers(wtq) if wtq else (w, w)),
        outer, W=write_w, WT=write_wt, SR=spec.sr, HAS_AMAX_SCALE=spec.amax_scale is not None,
        INNER=bool(inner and write_w), **four_over_six_constexprs(spec.four_over_six),
        SEED_PTR=seed_p, OFF_PTR=off_p)
    return (scales_as_e4m3(wq) if wq else None), (scales_as_e4m3(wtq) if wtq else None)


def empty_2d(lead: Tuple[int, ...], n: int, k: int, spec: QuantSpec, write_w: bool,
             write_wt: bool, inner: bool,
             device) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand], torch.Tensor]:
    """The empty outputs (W, W^T, outer scale) of a 2d quantization of (*lead, N, K) weights
    under ``spec`` (a Block.D2 spec, which both carry; scales as uint8 until the kernel has
    written them, :func:`scales_as_e4m3`; W as float16 inner values with ``inner``); W and W^T share
    the fp32 outer scale of shape ``lead``."""
    outer = empty(lead, torch.float32, device)
    wq = wtq = None
    if write_w and inner:
        wq = NVFP4Operand(None, None, outer, spec,
                          torch.empty(*lead, n, k, dtype=torch.float16, device=device))
    elif write_w:
        wq = NVFP4Operand(torch.empty(*lead, n, k // 2, dtype=torch.uint8, device=device),
                          torch.empty(*lead, n // 16, k // 16, dtype=torch.uint8, device=device),
                          outer, spec)
    if write_wt:
        wtq = NVFP4Operand(torch.empty(*lead, k, n // 2, dtype=torch.uint8, device=device),
                           torch.empty(*lead, k // 16, n // 16, dtype=torch.uint8, device=device),
                           outer, spec)
    return wq, wtq, outer


def check_inner(inner: bool, device: torch.device) -> None:
    """Raises ValueError when inner-value outputs are asked on a device without E4M3 conversion."""
    if inner and not inner_values_supported(device):
        raise ValueError(f"inner-value copies need E4M3 conversion (CUDA sm89+), not {device}")

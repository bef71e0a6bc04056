"""NVFP4 GEMM in Triton: D = (s_a * s_b) * (A_inner @ B_inner^T) + bias.

Both operands are NVFP4 matrices with their 16-element blocks along the reduction dimension K, as
the quantize kernels write them: packed E2M1 codes ``qdata`` (rows, K/2) uint8 (even element in the
low nibble), E4M3 block scales (rows, K/16) for 1d blocks or (rows/16, K/16) for 16x16 blocks, and an
fp32 outer scale, () per-tensor or (rows,) per-token. fprop (X @ W^T), dgrad (dY @ (W^T)^T) and wgrad
(dY^T @ (X^T)^T) are all this one product with K-major operands, so nothing is transposed in memory.

``A_inner`` = codes x block scales is exact in bf16 and in fp16 (a 2-bit times a 4-bit significand,
magnitudes 0 or 2**-10 .. 2688), so every method computes the products exactly, accumulates them in
fp32 on tensor cores and applies the outer scales and the bias once, in fp32, in an epilogue: the only
roundings are the fp32 accumulation and the final cast to ``out_dtype`` (no bf16 double rounding).
The GPU paths use fp16 for the inner values because sm89+ converts E4M3 pairs to fp16 pairs in one
instruction: a code (s e1 e0 m) becomes the E4M3 byte (s 0 0 e1 e0 m 0 0), worth value * 2**-6, and
one fp16 multiply by block scale * 64 finishes it (:data:`_DEQUANT_PTX`, about 2 instructions a value).

Methods (``scaled_mm(method=...)``), with their fraction of bf16 ``torch.mm`` throughput on an H200 at
M = 16384, K, N in {4096, 14336} (benchmarks/bench_gemm.py, docs/benchmarks.md):

- ``"dequant_triton"`` (0.97-1.0, the default on sm90+): a dequantize kernel writes A_inner and
  B_inner to memory (~3.3 TB/s), then a persistent Triton GEMM reads them through TMA descriptors
  (wgmma, pipelined) and applies the fp32 epilogue to its accumulator. :func:`inner_mm` is this
  second pass alone, for operands whose inner values a quantize kernel wrote directly.
- ``"dequant_cublas"`` (0.80-0.86; the default before sm90 and under the interpreter): the same
  dequantize kernel, cuBLAS ``torch.mm(..., out_dtype=torch.float32)``, then a Triton epilogue pass
  over the fp32 product (the fp32 round trip costs what the Triton GEMM saves).
- ``"fused"`` (0.48-0.53): one kernel loads the packed codes and scales, dequantizes them in registers
  and runs ``tl.dot`` (wgmma; A from registers, B through shared memory), epilogue fused. Each K step
  of 2*H elements is split into its even (low-nibble) and odd (high-nibble) elements, two dots of
  depth H: the same permutation of K for A and B, so the sum is unchanged up to fp32 order. Triton
  waits for each wgmma before the next dequantization, so the dequantization does not overlap the
  tensor cores within a block and the kernel is bound by it.

Inner values in memory are in the order of K (:func:`dequantize_inner` writes what the GEMMs read).

This module imports nothing from the rest of the package. Under ``TRITON_INTERPRET=1`` (CPU tests)
dots run on fp32 operands and 16-bit outputs are cast by torch, because the interpreter's 16-bit dot
and fp32->bf16 cast differ from the GPU's; the inline PTX runs on GPUs only. Sources: the NVFP4
format (OCP Microscaling spec v1.0; NVIDIA, arXiv 2509.25149), PTX ISA (cvt.f16x2.e4m3x2, sm89+),
Triton's matmul tutorials (grouped tile order, persistent TMA GEMM, epilogue subtiling).
"""

import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

BLOCK = 16
METHODS = ("fused", "dequant_triton", "dequant_cublas")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Read once, as triton.jit does when it decides whether a kernel runs in the interpreter.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRET


# ----------------------------------------------------------------------------------------------
# Triton building blocks
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_to_f32(code):
    """E2M1 codes (integer tensor, values 0-15) -> float32, by building the float's bits.

    Magnitude code m = (e1 e0 m0) is 2**(e - 1) * (1 + m0 / 2) for e > 0: exponent field e + 126 and
    top mantissa bit m0, i.e. bits ``(m << 22) + 0x3F000000``; codes 0 and 1 (0 and 0.5) are
    ``m * 0x3F000000``. The sign is bit 3 of the code.
    """
    c = code.to(tl.uint32)
    mag = c & 7
    bits = tl.where(mag < 2, mag * 0x3F000000, (mag << 22) + 0x3F000000)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# Both nibbles of 4 packed bytes (8 values) to fp16 times the block scale: 7 bit operations, 4
# conversions and 4 multiplies, about 2 instructions a value (15 in SASS, sm90). A code
# (s e1 e0 m) becomes the E4M3 byte (s 0 0 e1 e0 m 0 0): exponent field e, mantissa m/2, so its value
# is the E2M1 value times 2**-6 (code 1 = 0.5 is an E4M3 subnormal, exact); the hardware converts
# E4M3 pairs to fp16 pairs (sm89+), and one fp16 multiply by (block scale * 64) gives code x scale,
# exact in fp16 (0 or 2**-10 ... 2688, at most 6 significant bits). Elementwise: byte i of the pack
# gives output i of each result (low nibble, high nibble), whichever bytes Triton packs together.
_DEQUANT_PTX = tl.constexpr("""
{
.reg .b32 a, b, lo, hi;
.reg .b16 l0, l1, h0, h1;
shl.b32 a, $4, 2;
shl.b32 b, $4, 4;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, b, 0x80808080;
or.b32 lo, a, b;
shr.b32 a, $4, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, $4, 0x80808080;
or.b32 hi, a, b;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}
""")


@triton.jit
def _dequant_ptx(q, s, ROWS: tl.constexpr, H: tl.constexpr):
    """(lo, hi) fp16 (ROWS, H) from packed bytes q (ROWS, H) and fp32 scales s (ROWS, H // 8)."""
    s64 = tl.reshape(tl.broadcast_to((s * 64.0).to(tl.float16)[:, :, None], (ROWS, H // 8, 8)),
                     (ROWS, H))
    return tl.inline_asm_elementwise(_DEQUANT_PTX, "=r,=r,=r,=r,r,r,r", [q, s64],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _scale_blocks(v, s, ROWS: tl.constexpr, H: tl.constexpr):
    """v (ROWS, H) float32 values, one of every other element of 2*H; s (ROWS, H // 8) scales."""
    v = tl.reshape(v, (ROWS, H // 8, 8)) * s[:, :, None]
    return tl.reshape(v, (ROWS, H))


@triton.jit
def _load_codes(q_ptr, s_ptr, rows, kb, KB, stride_q, stride_s, H: tl.constexpr,
                BLOCK_2D: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed bytes [kb, kb + H) of ``rows`` (all in range) and their block scales: (q (ROWS, H)
    uint8, fp32 scales (ROWS, H // 8)). Bytes at or past KB (only when not EVEN_K) read as zero."""
    cols = kb + tl.arange(0, H)
    scols = kb // 8 + tl.arange(0, H // 8)
    srows = rows // 16 if BLOCK_2D else rows
    q_ptrs = q_ptr + rows[:, None] * stride_q + cols[None, :]
    s_ptrs = s_ptr + srows[:, None] * stride_s + scols[None, :]
    if EVEN_K:
        q = tl.load(q_ptrs)
        s = tl.load(s_ptrs)
    else:
        q = tl.load(q_ptrs, mask=cols[None, :] < KB, other=0)
        s = tl.load(s_ptrs, mask=scols[None, :] < KB // 8, other=0.0)
    return q, s.to(tl.float32)


@triton.jit
def _dequant_codes(q, s, ROWS: tl.constexpr, H: tl.constexpr, PTX: tl.constexpr):
    """Codes x block scales of packed bytes q (ROWS, H) with scales s (ROWS, H // 8): (lo, hi),
    each (ROWS, H), lo[:, j] the low nibble of byte j (element 2 j), hi[:, j] the high one;
    fp16 through :func:`_dequant_ptx` if PTX, else fp32."""
    if PTX:
        lo, hi = _dequant_ptx(q, s, ROWS, H)
    else:
        lo = _scale_blocks(_e2m1_to_f32(q & 0xF), s, ROWS, H)
        hi = _scale_blocks(_e2m1_to_f32(q >> 4), s, ROWS, H)
    return lo, hi


@triton.jit
def _load_dequant(q_ptr, s_ptr, rows, kb, KB, stride_q, stride_s, ROWS: tl.constexpr,
                  H: tl.constexpr, BLOCK_2D: tl.constexpr, EVEN_K: tl.constexpr,
                  PTX: tl.constexpr):
    """:func:`_dequant_codes` of :func:`_load_codes`: lo[:, j] is element 2 * (kb + j), hi[:, j]
    element 2 * (kb + j) + 1."""
    q, s = _load_codes(q_ptr, s_ptr, rows, kb, KB, stride_q, stride_s, H, BLOCK_2D, EVEN_K)
    return _dequant_codes(q, s, ROWS, H, PTX)


@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    """acc += a @ b with a (BM, BK), b (BK, BN) 16-bit floats; fp32 operands under the interpreter."""
    if INTERP:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_pid(tile_id, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile_id``, GROUP_M row tiles per sweep over the columns."""
    num_m = tl.cdiv(M, BM)
    width = GROUP_M * tl.cdiv(N, BN)
    first_m = (tile_id // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % width) % size_m, (tile_id % width) // size_m


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
              stride_o, HAS_BIAS: tl.constexpr):
    """out = (s_a * s_b) * acc (+ bias), all in fp32, cast once to out's dtype; masked to (M, N).

    The outer scales are vectors with stride 1 (per-token) or 0 (per-tensor: one value).
    """
    mask_m = offs_m < M
    mask_n = offs_n < N
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=0.0)
    sb = tl.load(sb_ptr + offs_n * stride_sb, mask=mask_n, other=0.0)
    d = (sa[:, None] * sb[None, :]) * acc
    if HAS_BIAS:
        d = d + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_o + offs_n[None, :]
    tl.store(out_ptrs, d.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_sa", "stride_sb"])
def _fused_gemm_kernel(aq_ptr, as_ptr, bq_ptr, bs_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr,
                       M, N, KB, stride_aq, stride_as, stride_bq, stride_bs, stride_sa, stride_sb,
                       stride_o, A_2D: tl.constexpr, B_2D: tl.constexpr,
                       HAS_BIAS: tl.constexpr, INTERP: tl.constexpr,
                       PTX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """One (BM, BN) tile of D from packed operands; K advances BK elements (BK // 2 bytes) a step.

    Dot operands are fp16 (exact inner values; fp32 under the interpreter); with PTX the
    dequantization is :func:`_dequant_ptx`, else the portable :func:`_e2m1_to_f32` path.
    """
    H: tl.constexpr = BK // 2
    pid_m, pid_n = _tile_pid(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows_a = offs_m % M  # wrap out-of-range rows onto valid ones: loads need no mask
    rows_b = offs_n % N
    dot_dtype = tl.float32 if INTERP else tl.float16
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB, H):
        a_lo, a_hi = _load_dequant(aq_ptr, as_ptr, rows_a, kb, KB, stride_aq, stride_as, BM, H,
                                   A_2D, EVEN_K, PTX)
        b_lo, b_hi = _load_dequant(bq_ptr, bs_ptr, rows_b, kb, KB, stride_bq, stride_bs, BN, H,
                                   B_2D, EVEN_K, PTX)
        acc = _mma(a_lo.to(dot_dtype), tl.trans(b_lo.to(dot_dtype)), acc, INTERP)
        acc = _mma(a_hi.to(dot_dtype), tl.trans(b_hi.to(dot_dtype)), acc, INTERP)
    _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
              stride_o, HAS_BIAS)


@triton.jit(do_not_specialize=["stride_sa", "stride_sb"])
def _gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K, stride_sa,
                 stride_sb, stride_o, HAS_BIAS: tl.constexpr, INTERP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """Persistent GEMM over dequantized 16-bit A_inner (M, K) and B_inner (N, K), read through TMA
    descriptors (blocks [BM, BK] and [BN, BK]; out-of-range reads are zero); fp32 epilogue, in two
    column halves if EPI_SPLIT == 2 (halves the shared memory its layout change needs). Program i
    takes tiles i, i + NUM_PROGRAMS, ... (NUM_PROGRAMS: one or two per SM; the grid may be smaller
    when there are fewer tiles)."""
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_pid(tile_id, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            b = b_desc.load([pid_n * BN, k])
            acc = _mma(a, b.T, acc, INTERP)
        offs_m = pid_m * BM + tl.arange(0, BM)
        if EPI_SPLIT == 2:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            offs_n = pid_n * BN + tl.arange(0, BN // 2)
            _epilogue(acc0, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa,
                      stride_sb, stride_o, HAS_BIAS)
            _epilogue(acc1, offs_m, offs_n + BN // 2, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr,
                      stride_sa, stride_sb, stride_o, HAS_BIAS)
        else:
            _epilogue(acc, offs_m, pid_n * BN + tl.arange(0, BN), M, N, sa_ptr, sb_ptr, bias_ptr,
                      out_ptr, stride_sa, stride_sb, stride_o, HAS_BIAS)


@triton.jit(do_not_specialize=["stride_sa", "stride_sb"])
def _epilogue_kernel(c_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, stride_c, stride_sa,
                     stride_sb, stride_o, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
    """out = (s_a * s_b) * C + bias for an fp32 product C (M, N); out may alias C."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    acc = tl.load(c_ptr + offs_m[:, None] * stride_c + offs_n[None, :], mask=mask, other=0.0)
    _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
              stride_o, HAS_BIAS)


@triton.jit
def _tile_origin(tile, KB, BR: tl.constexpr, H: tl.constexpr):
    """(rows, first byte) of dequantize tile ``tile``: BR rows x H bytes, a row band's tiles
    consecutive."""
    n_kb = tl.cdiv(KB, H)
    return (tile // n_kb) * BR + tl.arange(0, BR), (tile % n_kb) * H


@triton.jit
def load_codes_tile(q_ptr, s_ptr, R, KB, stride_q, stride_s, tile, BLOCK_2D: tl.constexpr,
                    BR: tl.constexpr, H: tl.constexpr, EVEN_K: tl.constexpr):
    """The codes and fp32 block scales of dequantize tile ``tile`` of an (R, 2 KB) operand, for
    :func:`store_inner_tile` (rows past R wrap onto valid ones; their stores are masked)."""
    rows, kb = _tile_origin(tile, KB, BR, H)
    return _load_codes(q_ptr, s_ptr, rows % R, kb, KB, stride_q, stride_s, H, BLOCK_2D, EVEN_K)


@triton.jit
def store_inner_tile(q, s, out_ptr, R, KB, stride_o, tile, BR: tl.constexpr, H: tl.constexpr,
                     EVEN_K: tl.constexpr, PTX: tl.constexpr):
    """Codes x block scales of tile ``tile`` (from :func:`load_codes_tile`) into the operand's
    columns [2 kb, 2 kb + 2 H) (those in range), in order."""
    rows, kb = _tile_origin(tile, KB, BR, H)
    lo, hi = _dequant_codes(q, s, BR, H, PTX)
    v = tl.reshape(tl.join(lo, hi), (BR, 2 * H))
    cols = tl.arange(0, 2 * H)[None, :]
    mask = (rows < R)[:, None]
    if not EVEN_K:
        mask = mask & (cols < 2 * (KB - kb))
    tl.store(out_ptr + rows[:, None] * stride_o + 2 * kb + cols, v.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, R, KB, stride_q, stride_s, stride_o,
                    BLOCK_2D: tl.constexpr, BR: tl.constexpr, H: tl.constexpr,
                    EVEN_K: tl.constexpr, PTX: tl.constexpr):
    """One dequantize tile a program (:func:`load_codes_tile`, :func:`store_inner_tile`): a 1-D
    grid with the tiles of a row band fastest, so that the programs running together read and
    write whole rows rather than a column strip of the whole matrix (0.067 -> 0.062 ms for both
    operands at 16384 x 4096 x 4096 on the H200, one run each)."""
    tile = tl.program_id(0)
    q, s = load_codes_tile(q_ptr, s_ptr, R, KB, stride_q, stride_s, tile, BLOCK_2D, BR, H, EVEN_K)
    store_inner_tile(q, s, out_ptr, R, KB, stride_o, tile, BR, H, EVEN_K, PTX)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
class Operand(NamedTuple):
    """A validated NVFP4 operand (rows, K) with blocks along K; qdata viewed as uint8."""

    qdata: torch.Tensor
    scale: torch.Tensor
    outer: torch.Tensor
    block: str

    @property
    def rows(self) -> int:
        return self.qdata.shape[0]

    @property
    def k(self) -> int:
        return 2 * self.qdata.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qdata.device


class InnerOperand(NamedTuple):
    """A validated dequantized operand (rows, K): fp16 inner values (codes x block scales, K
    contiguous) and the fp32 outer scale."""

    values: torch.Tensor
    outer: torch.Tensor

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.values.device


def _check_outer(name: str, outer: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    if outer.dtype != torch.float32:
        raise TypeError(f"{name}: the outer scale must be float32, got {outer.dtype}")
    if outer.dim() != 0 and tuple(outer.shape) != (rows,):
        raise ValueError(f"{name}: the outer scale must be () or ({rows},), got {tuple(outer.shape)}")
    if outer.device != device:
        raise ValueError(f"{name}: the outer scale is on {outer.device}, the data on {device}")
    return outer.contiguous()


def check_operand(name: str, qdata: torch.Tensor, scale: torch.Tensor,
                  outer: Optional[torch.Tensor], block: str) -> Operand:
    """Validate one operand (``outer`` may be None: the inner values alone).

    Raises:
        TypeError: qdata not uint8/float4_e2m1fn_x2, scale not float8_e4m3fn, outer not float32.
        ValueError: wrong ranks or shapes, K or (2d) rows not multiples of 16, a unit-stride last
            dimension missing, an unknown block kind, or tensors on different devices.
    """
    if block not in ("1d", "2d"):
        raise ValueError(f"{name}: block must be '1d' or '2d', got {block!r}")
    if qdata.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        qdata = qdata.view(torch.uint8)
    if qdata.dtype != torch.uint8:
        raise TypeError(f"{name}: packed E2M1 data must be uint8 or float4_e2m1fn_x2, got {qdata.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: block scales must be float8_e4m3fn, got {scale.dtype}")
    if qdata.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"{name}: qdata and scale must be 2-D, got {tuple(qdata.shape)} and "
                         f"{tuple(scale.shape)}")
    rows, k = qdata.shape[0], 2 * qdata.shape[1]
    if k % BLOCK:
        raise ValueError(f"{name}: K = {k} (2 x qdata.shape[1]) must be a multiple of {BLOCK}")
    if block == "2d" and rows % BLOCK:
        raise ValueError(f"{name}: 2d blocks need rows a multiple of {BLOCK}, got {rows}")
    want = (rows // BLOCK if block == "2d" else rows, k // BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: {block} block scales for qdata {tuple(qdata.shape)} must have "
                         f"shape {want}, got {tuple(scale.shape)}")
    for t, what in ((qdata, "qdata"), (scale, "scale")):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {what} must be contiguous along K (stride 1), got strides "
                             f"{t.stride()}; the GEMM never transposes quantized data")
        if t.device != qdata.device:
            raise ValueError(f"{name}: {what} is on {t.device}, qdata on {qdata.device}")
    if outer is not None:
        outer = _check_outer(name, outer, rows, qdata.device)
    return Operand(qdata, scale, outer, block)


def check_inner(name: str, values: torch.Tensor, outer: torch.Tensor) -> InnerOperand:
    """Validate one dequantized operand for :func:`inner_mm`.

    Raises:
        TypeError: values not float16, outer not float32.
        ValueError: values not a contiguous 2-D tensor with K a multiple of 16, a wrongly shaped
            outer scale, or tensors on different devices.
    """
    if values.dtype != torch.float16:
        raise TypeError(f"{name}: inner values must be float16, got {values.dtype}")
    if values.dim() != 2 or values.shape[1] % BLOCK:
        raise ValueError(f"{name}: inner values must be (rows, K) with K a multiple of {BLOCK}, got "
                         f"{tuple(values.shape)}")
    if not values.is_contiguous():
        raise ValueError(f"{name}: inner values must be contiguous, got strides {values.stride()}")
    return InnerOperand(values, _check_outer(name, outer, values.shape[0], values.device))


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton NVFP4 kernels need CUDA tensors (or TRITON_INTERPRET=1 to run "
                         f"them in the Triton interpreter), got tensors on {device}")


def _check_gemm(a, b, bias: Optional[torch.Tensor], out_dtype) -> None:
    """Checks across two validated operands (:class:`Operand` or :class:`InnerOperand`)."""
    if a.k != b.k:
        raise ValueError(f"K mismatch: A is ({a.rows}, {a.k}), B is ({b.rows}, {b.k})")
    if a.device != b.device:
        raise ValueError(f"A is on {a.device}, B on {b.device}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if tuple(bias.shape) != (b.rows,) or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating ({b.rows},) tensor, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {a.device}")


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
# Tile configs: BM, BN, BK (elements), GROUP_M, num_warps, num_stages. The GPU defaults were picked by
# benchmarks/bench_gemm.py on an H200; the interpreter takes one small config.
_INTERP_CONFIG = dict(BM=32, BN=32, BK=64, GROUP_M=2, num_warps=4, num_stages=1)
_INTERP_GEMM_CONFIG = dict(_INTERP_CONFIG, EPI_SPLIT=2)
FUSED_CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=3)
# EPI_SPLIT is 1 for 16-bit outputs; fp32 outputs take 2 (one tile's fp32 layout change in shared
# memory besides 3 pipeline stages would exceed the 227 KB a block may use). P: programs per SM.
GEMM_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=16, EPI_SPLIT=1, num_warps=8, num_stages=3, P=1)
# For K <= SMALL_K (the products of small layers): 128 x 128 tiles, two programs per SM. A tile's
# K loop is short there, and one program's loop overlaps the other's epilogue: 2-7% faster on the
# gpu-preset shapes (32768 x {512, 1536, 2048}), 6% slower at K = 4096 (H200, 2026-11-21).
SMALL_K = 2048
SMALL_K_GEMM_CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=4,
                           num_stages=3, P=2)
DEQUANT_CONFIG = dict(BR=32, BK=256, num_warps=4)
_INTERP_DEQUANT_CONFIG = dict(BR=16, BK=64, num_warps=4)
EPILOGUE_CONFIG = dict(BM=64, BN=128, num_warps=8)

# The compiled kernel of each method's last launch (for inspection: asm["ptx"], asm["cubin"]).
LAST_KERNEL = {}


def _kernel_out(m: int, n: int, out_dtype, device) -> torch.Tensor:
    """The output buffer: fp32 under the interpreter (torch casts it), else ``out_dtype``."""
    dtype = torch.float32 if interpreting() else out_dtype
    return torch.empty((m, n), dtype=dtype, device=device)


def _finish(out: torch.Tensor, out_dtype) -> torch.Tensor:
    return out.to(out_dtype)


def _epilogue_args(a_outer: torch.Tensor, b_outer: torch.Tensor, bias: Optional[torch.Tensor]):
    """(s_a, s_b, bias pointer), the outer scales' strides (1 per-token, 0 per-tensor), flags."""
    bias_arg = bias if bias is not None else a_outer  # a dummy pointer when HAS_BIAS is False
    return (a_outer, b_outer, bias_arg), (int(a_outer.dim() == 1), int(b_outer.dim() == 1)), \
        dict(HAS_BIAS=bias is not None)


@functools.lru_cache(maxsize=None)
def _cuda_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, cached: the uncached query costs
    several µs of host time, and a layer's fwd+bwd asks a dozen times."""
    return torch.cuda.get_device_properties(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, the size of a persistent grid (4 under the
    interpreter or off CUDA)."""
    if interpreting() or device.type != "cuda":
        return 4
    return _cuda_props(device).multi_processor_count


def _capability(device: torch.device):
    props = _cuda_props(device)
    return props.major, props.minor


def has_e4m3_convert(device: torch.device) -> bool:
    """Whether ``device`` converts E4M3 to fp16 in hardware (CUDA sm89+), which the inline-PTX
    dequantization and the quantize kernels' inner-value output need."""
    return device.type == "cuda" and _capability(device) >= (8, 9)


def inner_values_supported(device: torch.device) -> bool:
    """Whether the quantize kernels can write fp16 inner values on ``device`` (E4M3 conversion,
    or the interpreter)."""
    return interpreting() or has_e4m3_convert(device)


def _ptx_dequant(device: torch.device) -> bool:
    """Whether the kernels can use the inline-PTX dequantization (a GPU with E4M3 conversion)."""
    return not interpreting() and has_e4m3_convert(device)


def _launch_fused(a: Operand, b: Operand, bias, out_dtype, cfg: Optional[dict] = None):
    """The "fused" method: one kernel from packed operands to the output."""
    cfg = dict(_INTERP_CONFIG if interpreting() else (cfg or FUSED_CONFIG))
    m, n, kb = a.rows, b.rows, a.k // 2
    out = _kernel_out(m, n, out_dtype, a.qdata.device)
    scales, strides, flags = _epilogue_args(a.outer, b.outer, bias)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    LAST_KERNEL["fused"] = _fused_gemm_kernel[grid](
        a.qdata, a.scale, b.qdata, b.scale, *scales, out, m, n, kb,
        a.qdata.stride(0), a.scale.stride(0), b.qdata.stride(0), b.scale.stride(0), *strides,
        out.stride(0), A_2D=a.block == "2d", B_2D=b.block == "2d", INTERP=interpreting(),
        PTX=_ptx_dequant(a.qdata.device), EVEN_K=kb % (cfg["BK"] // 2) == 0, **flags, **cfg)
    return _finish(out, out_dtype)


def _launch_gemm(a_inner: torch.Tensor, a_outer: torch.Tensor, b_inner: torch.Tensor,
                 b_outer: torch.Tensor, bias, out_dtype, cfg: Optional[dict] = None):
    """Second pass of "dequant_triton": the TMA GEMM over 16-bit inner values (sm90+)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = a_inner.shape, b_inner.shape[0]
    cfg = dict(cfg or gemm_config(k, out_dtype))
    programs = num_sms(a_inner.device) * cfg.pop("P", 1)
    out = _kernel_out(m, n, out_dtype, a_inner.device)
    scales, strides, flags = _epilogue_args(a_outer, b_outer, bias)
    a_desc = TensorDescriptor.from_tensor(a_inner, [cfg["BM"], cfg["BK"]])
    b_desc = TensorDescriptor.from_tensor(b_inner, [cfg["BN"], cfg["BK"]])
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    LAST_KERNEL["dequant_triton"] = _gemm_kernel[(min(programs, tiles),)](
        a_desc, b_desc, *scales, out, m, n, k, *strides, out.stride(0), INTERP=interpreting(),
        NUM_PROGRAMS=programs, **flags, **cfg)
    return _finish(out, out_dtype)


def gemm_config(k: int, out_dtype: torch.dtype) -> dict:
    """The tile config of the Triton TMA GEMM for a reduction length ``k`` and output dtype
    (GEMM_CONFIG, SMALL_K_GEMM_CONFIG for k <= SMALL_K; the interpreter's own config)."""
    if interpreting():
        return _INTERP_GEMM_CONFIG
    cfg = SMALL_K_GEMM_CONFIG if k <= SMALL_K else GEMM_CONFIG
    return dict(cfg, EPI_SPLIT=2 if out_dtype == torch.float32 else 1)


def _mm_f32(a_inner: torch.Tensor, b_inner: torch.Tensor) -> torch.Tensor:
    """A_inner @ B_inner^T in fp32 from 16-bit operands (cuBLAS on CUDA; an fp32 matmul on CPU)."""
    if a_inner.is_cuda:
        return torch.mm(a_inner, b_inner.t(), out_dtype=torch.float32)
    return torch.mm(a_inner.float(), b_inner.float().t())


def apply_epilogue(c: torch.Tensor, a_outer: torch.Tensor, b_outer: torch.Tensor, bias, out_dtype,
                   cfg: Optional[dict] = None) -> torch.Tensor:
    """(s_a * s_b) * C + bias for an fp32 (M, N) product C, one fp32 pass; in place for fp32 out."""
    cfg = dict(cfg or EPILOGUE_CONFIG)
    m, n = c.shape
    out = c if out_dtype == torch.float32 else _kernel_out(m, n, out_dtype, c.device)
    scales, strides, flags = _epilogue_args(a_outer, b_outer, bias)
    grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(n, cfg["BN"]))
    LAST_KERNEL["epilogue"] = _epilogue_kernel[grid](c, *scales, out, m, n, c.stride(0), *strides,
                                                     out.stride(0), **flags, **cfg)
    return _finish(out, out_dtype)


def _dequant_config(cfg: Optional[dict]) -> dict:
    """The dequantize tile config: ``cfg`` or DEQUANT_CONFIG; the interpreter's own."""
    return _INTERP_DEQUANT_CONFIG if interpreting() else (cfg or DEQUANT_CONFIG)


def dequant_job(op: Operand, out: torch.Tensor, cfg: Optional[dict] = None):
    """The arguments of :func:`load_codes_tile` and :func:`store_inner_tile` for writing a
    validated operand's inner values into ``out`` ((rows, K), contiguous along K): (pointer and
    size arguments, constexprs, number of tiles). The dequantize kernel runs one tile a program;
    the quantize pair kernel runs a share of them after its own work
    (``kernels.quantize.quantize_1d(dequantize=...)``)."""
    cfg = _dequant_config(cfg)
    h, kb = cfg["BK"] // 2, op.k // 2
    args = (op.qdata, op.scale, out, op.rows, kb, op.qdata.stride(0), op.scale.stride(0),
            out.stride(0))
    consts = dict(BLOCK_2D=op.block == "2d", BR=cfg["BR"], H=h, EVEN_K=kb % h == 0,
                  PTX=out.dtype == torch.float16 and _ptx_dequant(op.qdata.device))
    return args, consts, triton.cdiv(op.rows, cfg["BR"]) * triton.cdiv(kb, h)


def _dequantize(op: Operand, out_dtype, cfg: Optional[dict] = None) -> torch.Tensor:
    """Launch :func:`_dequant_kernel` on a validated operand; (rows, K) of ``out_dtype``."""
    out = torch.empty((op.rows, op.k), dtype=out_dtype, device=op.qdata.device)
    if out.numel() == 0:
        return out
    args, consts, tiles = dequant_job(op, out, cfg)
    LAST_KERNEL["dequant"] = _dequant_kernel[(tiles,)](*args, **consts,
                                                       num_warps=_dequant_config(cfg)["num_warps"])
    return out


def dequantize_inner(qdata: torch.Tensor, scale: torch.Tensor, block: str = "1d",
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes x block scales (no outer scale) as a (rows, K) tensor, like ``reference.dequantize_inner``.

    Args:
        qdata: (rows, K/2) uint8 (or float4_e2m1fn_x2) packed E2M1 codes, contiguous along K.
        scale: float8_e4m3fn block scales, (rows, K/16) for "1d", (rows/16, K/16) for "2d".
        out_dtype: bfloat16, float16 or float32; exact in each (the values are 0 or between 2**-10
            and 2688 in magnitude with at most 6 significant bits).
    Raises:
        TypeError, ValueError: see :func:`check_operand`; ValueError for CPU tensors outside the
            interpreter.
    """
    op = check_operand("operand", qdata, scale, None, block)
    _check_runnable(op.qdata.device)
    return _dequantize(op, out_dtype)


def _inner_pair(a: Operand, b: Operand, cfg: Optional[dict] = None):
    """A_inner and B_inner for a two-pass GEMM, fp16 (exact)."""
    return _dequantize(a, torch.float16, cfg), _dequantize(b, torch.float16, cfg)


def _empty_product(a_outer, b_outer, m: int, n: int, bias, out_dtype) -> torch.Tensor:
    """The result when M, N or K is 0 (no kernel launch): the epilogue applied to zeros."""
    s_a = a_outer[:, None] if a_outer.dim() else a_outer
    s_b = b_outer[None, :] if b_outer.dim() else b_outer
    d = (s_a * s_b) * torch.zeros((m, n), device=a_outer.device)
    return (d if bias is None else d + bias.float()).to(out_dtype)


def default_method(m: int, n: int, k: int, device: torch.device) -> str:
    """The method ``scaled_mm(method="auto")`` uses for an (m, k) x (n, k) product on ``device``:
    "dequant_triton" on sm90+ when the output has at least one GEMM_CONFIG tile per SM (TMA;
    fastest at every benchmarked shape on an H200, see docs/benchmarks.md); "dequant_cublas" for
    fewer output tiles (the wgrad of small layers: a small output with a long K, which cuBLAS
    splits along K and our persistent kernel does not), on older GPUs and under the interpreter."""
    if device.type == "cuda" and not interpreting() and _capability(device) >= (9, 0):
        tiles = triton.cdiv(m, GEMM_CONFIG["BM"]) * triton.cdiv(n, GEMM_CONFIG["BN"])
        if tiles >= num_sms(device):
            return "dequant_triton"
    return "dequant_cublas"


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------
def scaled_mm(a_qdata: torch.Tensor, a_scale: torch.Tensor, a_outer: torch.Tensor,
              b_qdata: torch.Tensor, b_scale: torch.Tensor, b_outer: torch.Tensor, *,
              a_block: str = "1d", b_block: str = "1d", bias: Optional[torch.Tensor] = None,
              out_dtype: torch.dtype = torch.bfloat16, method: str = "auto") -> torch.Tensor:
    """NVFP4 GEMM D = (s_a * s_b) * (A_inner @ B_inner^T) + bias, the semantics of ``reference.scaled_mm``.

    Args:
        a_qdata, a_scale, a_outer: A (M, K): packed codes (M, K/2) uint8 or float4_e2m1fn_x2,
            float8_e4m3fn block scales (M, K/16) for a_block "1d" or (M/16, K/16) for "2d", and a
            float32 outer scale of shape () (per-tensor) or (M,) (per-token).
        b_qdata, b_scale, b_outer: B (N, K), likewise, with b_block; outer () or (N,).
        bias: optional (N,) floating tensor, added in fp32 after the outer scales.
        out_dtype: bfloat16, float16 or float32.
        method: "auto", "fused", "dequant_triton" or "dequant_cublas" (see the module docstring).
    Returns:
        (M, N) tensor of ``out_dtype`` on the operands' device. Products are exact, the sum is fp32
        (its order differs from the reference's), the outer scales and bias are applied in fp32 and
        the result is rounded once to ``out_dtype``.
    Raises:
        TypeError: wrong dtypes (see :func:`check_operand`) or an unsupported ``out_dtype``.
        ValueError: bad shapes, K mismatch, K not a multiple of 16, tensors on different devices
            or off CUDA (outside the interpreter), an unknown method.
    """
    a = check_operand("A", a_qdata, a_scale, a_outer, a_block)
    b = check_operand("B", b_qdata, b_scale, b_outer, b_block)
    method = _resolve(a, b, bias, out_dtype, method, METHODS)
    if a.rows == 0 or b.rows == 0 or a.k == 0:
        return _empty_product(a.outer, b.outer, a.rows, b.rows, bias, out_dtype)
    if method == "fused":
        return _launch_fused(a, b, bias, out_dtype)
    a_inner, b_inner = _inner_pair(a, b)
    return _second_pass(InnerOperand(a_inner, a.outer), InnerOperand(b_inner, b.outer), bias,
                        out_dtype, method == "dequant_triton")


def _resolve(a, b, bias, out_dtype, method: str, allowed) -> str:
    """Check a product of two validated operands and resolve ``method`` ("auto" or one of
    ``allowed``) for it; raises as :func:`scaled_mm`."""
    _check_gemm(a, b, bias, out_dtype)
    if method == "auto":
        method = default_method(a.rows, b.rows, a.k, a.device)
    if method not in allowed:
        raise ValueError(f"method must be 'auto' or one of {allowed}, got {method!r}")
    _check_runnable(a.device)
    return method


def _second_pass(a: InnerOperand, b: InnerOperand, bias, out_dtype, triton_gemm: bool):
    """The GEMM of the two-pass methods: the Triton TMA GEMM or cuBLAS plus the epilogue pass."""
    if triton_gemm:
        return _launch_gemm(a.values, a.outer, b.values, b.outer, bias, out_dtype)
    return apply_epilogue(_mm_f32(a.values, b.values), a.outer, b.outer, bias, out_dtype)


def inner_mm(a_inner: torch.Tensor, a_outer: torch.Tensor, b_inner: torch.Tensor,
             b_outer: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
             out_dtype: torch.dtype = torch.bfloat16, method: str = "auto") -> torch.Tensor:
    """D = (s_a * s_b) * (A_inner @ B_inner^T) + bias from operands already dequantized to their
    inner values: the second pass of the two-pass :func:`scaled_mm` methods, for operands that a
    quantize kernel wrote as inner values (``kernels.quantize.CopySpec(inner=True)``) or that
    :func:`dequantize_inner` gave.

    Args:
        a_inner, a_outer: A (M, K): float16 inner values (codes x block scales, contiguous) and the
            float32 outer scale, () or (M,).
        b_inner, b_outer: B (N, K), likewise; outer () or (N,).
        bias, out_dtype: as :func:`scaled_mm`.
        method: "auto" (the rule of :func:`default_method`), "dequant_triton" (the Triton TMA GEMM,
            sm90+) or "dequant_cublas" (cuBLAS fp32 product, then the epilogue pass).
    Returns:
        (M, N) tensor of ``out_dtype``: the same value :func:`scaled_mm` gives for the quantized
        operands with the same method.
    Raises:
        TypeError, ValueError: see :func:`check_inner` and :func:`scaled_mm`.
    """
    a = check_inner("A", a_inner, a_outer)
    b = check_inner("B", b_inner, b_outer)
    method = _resolve(a, b, bias, out_dtype, method, METHODS[1:])
    if a.rows == 0 or b.rows == 0 or a.k == 0:
        return _empty_product(a.outer, b.outer, a.rows, b.rows, bias, out_dtype)
    return _second_pass(a, b, bias, out_dtype, method == "dequant_triton")

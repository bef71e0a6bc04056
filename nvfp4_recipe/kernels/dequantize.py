"""Dequantization of NVFP4 operands to their inner values (codes x block scales), in Triton.

``A_inner`` = codes x block scales is exact in bf16 and in fp16 (a 2-bit times a 4-bit significand,
magnitudes 0 or 2**-10 .. 2688), so the GEMMs (``kernels.gemm``) take 16-bit inner values and lose
nothing. On GPUs with E4M3 conversion (sm89+) a code (s e1 e0 m) becomes the E4M3 byte
(s 0 0 e1 e0 m 0 0), worth value * 2**-6, which the hardware converts to fp16 in pairs; one fp16
multiply by block scale * 64 finishes it (:func:`_dequant_ptx`, about 2 instructions a value).
Elsewhere (and under the interpreter, which runs no inline PTX) the portable path builds the fp32
bits of each code. The tile helpers are shared with the quantize kernel that dequantizes another
operand in the same pass (``kernels.quantize.quantize_1d(dequantize=...)``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..operand import NVFP4Operand
from ..spec import Block, QuantSpec
from .runtime import Launcher, cdiv, check_runnable, interpreting, ptx_dequant

BLOCK = 16

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


@triton.jit
def _dequant_ptx(q, s, ROWS: tl.constexpr, H: tl.constexpr):
    """(lo, hi) fp16 (ROWS, H) from packed bytes q (ROWS, H) and fp32 scales s (ROWS, H // 8)."""
    s64 = tl.reshape(tl.broadcast_to((s * 64.0).to(tl.float16)[:, :, None], (ROWS, H // 8, 8)),
                     (ROWS, H))
    # the PTX is a literal here, not a global constexpr: torch.compile copies this function's
    # source into Inductor's code, and a multi-line global string does not survive that copy
    return tl.inline_asm_elementwise("""
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
""", "=r,=r,=r,=r,r,r,r", [q, s64],
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
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
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
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + 2 * kb + cols,
             v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, R, KB, stride_q, stride_s, stride_o,
                    BLOCK_2D: tl.constexpr, BR: tl.constexpr, H: tl.constexpr,
                    EVEN_K: tl.constexpr, PTX: tl.constexpr):
    """One dequantize tile a program (:func:`load_codes_tile`, :func:`store_inner_tile`): a 1-D
    grid with the tiles of a row band fastest, so that the programs running together read and
    write whole rows rather than a column strip of the whole matrix (measured faster)."""
    tile = tl.program_id(0)
    q, s = load_codes_tile(q_ptr, s_ptr, R, KB, stride_q, stride_s, tile, BLOCK_2D, BR, H, EVEN_K)
    store_inner_tile(q, s, out_ptr, R, KB, stride_o, tile, BR, H, EVEN_K, PTX)


_DEQUANT = Launcher(_dequant_kernel)


# ----------------------------------------------------------------------------------------------
# Validation and launch
# ----------------------------------------------------------------------------------------------
def check_outer(name: str, outer: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """The outer scale of an operand of ``rows`` rows, contiguous.

    Raises:
        TypeError: not float32. ValueError: not () or (rows,), or on another device.
    """
    if outer.dtype != torch.float32:
        raise TypeError(f"{name}: the outer scale must be float32, got {outer.dtype}")
    if outer.dim() != 0 and tuple(outer.shape) != (rows,):
        raise ValueError(f"{name}: the outer scale must be () or ({rows},), got {tuple(outer.shape)}")
    if outer.device != device:
        raise ValueError(f"{name}: the outer scale is on {outer.device}, the data on {device}")
    return outer.contiguous()


def check_codes(name: str, op: NVFP4Operand, outer: bool = True) -> NVFP4Operand:
    """Validate an operand's codes, block scales, spec and (``outer``) outer scale; returns it with
    qdata viewed as uint8 and the outer scale contiguous. With ``outer`` False the outer scale is
    neither checked nor needed (a dequantize to inner values).

    Raises:
        TypeError: qdata not uint8/float4_e2m1fn_x2, scale not float8_e4m3fn, outer not float32.
        ValueError: no codes, a spec that is not a :class:`QuantSpec`, wrong ranks or shapes, K
            or (2d) rows not multiples of 16, a unit-stride last dimension missing, or tensors on
            different devices.
    """
    qdata, scale = op.qdata, op.scale
    if qdata is None or scale is None:
        raise ValueError(f"{name}: the operand has no codes and block scales")
    if not isinstance(op.spec, QuantSpec):
        raise ValueError(f"{name}: spec must be a QuantSpec, got {op.spec!r}")
    block = op.block
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
    if block is Block.D2 and rows % BLOCK:
        raise ValueError(f"{name}: 2d blocks need rows a multiple of {BLOCK}, got {rows}")
    want = (rows // BLOCK if block is Block.D2 else rows, k // BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: {block.value} block scales for qdata {tuple(qdata.shape)} must "
                         f"have shape {want}, got {tuple(scale.shape)}")
    for t, what in ((qdata, "qdata"), (scale, "scale")):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {what} must be contiguous along K (stride 1), got strides "
                             f"{t.stride()}; the GEMM never transposes quantized data")
        if t.device != qdata.device:
            raise ValueError(f"{name}: {what} is on {t.device}, qdata on {qdata.device}")
    if outer:
        op = op._replace(outer_scale=check_outer(name, op.outer_scale, rows, qdata.device))
    return op._replace(qdata=qdata)


DEQUANT_CONFIG = dict(BR=32, BK=256, num_warps=4)


_INTERP_DEQUANT_CONFIG = dict(BR=16, BK=64, num_warps=4)


def _dequant_config(cfg: Optional[dict]) -> dict:
    """The dequantize tile config: ``cfg`` or DEQUANT_CONFIG; the interpreter's own."""
    return _INTERP_DEQUANT_CONFIG if interpreting() else (cfg or DEQUANT_CONFIG)


def dequant_job(op: NVFP4Operand, out: torch.Tensor, cfg: Optional[dict] = None):
    """The arguments of :func:`load_codes_tile` and :func:`store_inner_tile` for writing a
    validated operand's inner values into ``out`` ((rows, K), contiguous along K): (pointer and
    size arguments, constexprs, number of tiles). The dequantize kernel runs one tile a program;
    the quantize pair kernel runs a share of them after its own work
    (``kernels.quantize.quantize_1d(dequantize=...)``)."""
    cfg = _dequant_config(cfg)
    h, kb = cfg["BK"] // 2, op.k // 2
    args = (op.qdata, op.scale, out, op.rows, kb, op.qdata.stride(0), op.scale.stride(0),
            out.stride(0))
    consts = dict(BLOCK_2D=op.block is Block.D2, BR=cfg["BR"], H=h, EVEN_K=kb % h == 0,
                  PTX=out.dtype == torch.float16 and ptx_dequant(op.qdata.device))
    return args, consts, cdiv(op.rows, cfg["BR"]) * cdiv(kb, h)


def dequantize_inner(op: NVFP4Operand, out_dtype: torch.dtype = torch.bfloat16,
                     cfg: Optional[dict] = None) -> torch.Tensor:
    """codes x block scales (no outer scale) of an operand as a (rows, K) tensor, exactly
    ``reference.dequantize_inner``; one dequantize pass.

    Args:
        op: an :class:`NVFP4Operand` with codes: qdata (rows, K/2) uint8 or float4_e2m1fn_x2,
            contiguous along K; scale float8_e4m3fn (rows, K/16) for Block.D1, (rows/16, K/16)
            for Block.D2; its outer scale is not used (it may be None).
        out_dtype: bfloat16, float16 or float32; exact in each (the values are 0 or between 2**-10
            and 2688 in magnitude with at most 5 significant bits).
        cfg: a tile config (benchmarks), default DEQUANT_CONFIG.
    Raises:
        TypeError, ValueError: see :func:`check_codes` (outer=False); ValueError for CPU tensors
            outside the interpreter.
    """
    op = check_codes("operand", op, outer=False)
    check_runnable(op.qdata.device)
    return dequantize_valid(op, out_dtype, cfg)


def dequantize_valid(op: NVFP4Operand, out_dtype: torch.dtype = torch.float16,
                     cfg: Optional[dict] = None) -> torch.Tensor:
    """:func:`dequantize_inner` of an operand that :func:`check_codes` returned, on a device the
    kernels run on, without validating it again (the GEMM's operands, validated once)."""
    out = torch.empty((op.rows, op.k), dtype=out_dtype, device=op.qdata.device)
    if out.numel() == 0:
        return out
    args, consts, tiles = dequant_job(op, out, cfg)
    _DEQUANT[(tiles,)](*args, **consts, num_warps=_dequant_config(cfg)["num_warps"])
    return out

"""Grouped NVFP4 kernels for mixture-of-experts layers: quantization of token groups and of expert
weights, and the grouped GEMM.

The operands (``operand.GroupedOperand``; docs/moe.md): the tokens of all experts form one (T, K)
matrix whose rows are split into G contiguous groups by ``offs`` (int32 (G,), cumulative group
ends, ``torch._grouped_mm``'s convention); group g is expert g's tokens. Every group's length must
be a multiple of 16 (the wgrad copies have blocks of 16 tokens, which must not straddle two
experts; callers pad each group, as TransformerEngine and torchao require). Rows past ``offs[-1]``
belong to no group: they are neither quantized nor read, and the fprop/dgrad outputs hold zeros
there. Expert weights are (G, N, K) tensors.

- :func:`quantize_grouped`: one amax pass (:func:`grouped_amax_pass`) then one launch that writes,
  from one read of x, the rowwise copy (blocks along K) and the columnwise copy (each group's
  x_g^T, blocks of 16 tokens, optionally through the RHT along the tokens), each with RN or SR and
  an outer scale per group or per token. Group g's bits equal ``reference.quantize`` called on
  that group alone with the SR counter bases below (tests/test_kernels_grouped.py).
- :func:`quantize_experts`: the (G, N, K) weights per expert, 2D 16x16 blocks (W_g and its exact
  transpose from one read, one launch for all experts) or 1D blocks.
- :func:`grouped_scaled_mm`: fprop and dgrad (``A`` grouped by rows, ``B`` one (N, K) operand per
  expert) and wgrad (both operands grouped along K, the tokens; one (N, K') output per expert), one
  persistent launch on 16-bit inner values (read through TMA descriptors on sm90+) with fp32
  accumulation and the outer scales in an fp32 epilogue, rounded once.
  ``torch._grouped_mm`` cannot take over here: torch 2.13 refuses an fp32 output for bf16 inputs
  (``_resolve_grouped_mm_out_dtype``), and rounding the product to bf16 before the outer scales
  would round twice.

SR streams, per group (docs/moe.md): the rowwise copy of group g is the dense quantization of x_g
with counter base ``row_offset + start_g * K / 16``, i.e. the counters of the whole matrix's dense
rowwise copy; the columnwise copy of group g is that of x_g^T (K, M_g) with counter base
``col_offset + start_g * K / 16``, so the groups take disjoint ranges covering the dense copy's.
Expert g's weight stream has counter base ``offset + g * N * K / 16``.
"""

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..operand import GroupedOperand, NVFP4Operand
from ..spec import Block, Form, QuantSpec
from .amax import _configs as _amax_configs
from .amax import block_max_bits, check_matrix, rht_block_max_bits
from .dequantize import dequantize_inner
from .four_over_six import fos_code, lead_tile
from .gemm import OUT_DTYPES, _epilogue, _kernel_out, _mma, _tile_pid
from .hadamard import rht16
from .quantize import (_finished, _pointers, _quantize_store, _u32, check_inner, dequantize_job,
                       empty_2d, empty_copy, quantize_2d_tile, ride_dequantize)
from .rounding import abs_bits, outer_scales, round_to
from .runtime import (Launcher, autotune, capability, cdiv, check_runnable, interpreting, next_pow2,
                      num_sms, prune_wide_tiles, scalar, scalar_arg)
from .tiles import load_col_blocks, load_row_blocks

IntOrTensor = Union[int, torch.Tensor]
NONE, PER_GROUP, PER_INDEX = 0, 1, 2  # what an amax or outer-scale output holds
GC = tl.constexpr(16)  # group ends read per step when looking up the group of a row block


def _configs():
    """Autotuning space of the quantize kernels: (BB, BC) = a tile of 16 BB x 16 BC elements.
    Untuned on GPUs yet (benchmarks/bench_moe.py); one small tile in the interpreter. The amax
    kernel takes the dense amax kernel's space (``amax._configs``, with P programs per SM)."""
    if interpreting():
        return [triton.Config({"BB": 2, "BC": 2}, num_warps=1)]
    return [triton.Config({"BB": bb, "BC": bc}, num_warps=nw)
            for bb, bc, nw in ((2, 8, 4), (2, 4, 4), (4, 8, 4), (4, 8, 8))]


def _prune(*fos_flags: str):
    """The autotuner's pruning of a kernel whose 4/6 constexprs are ``fos_flags``."""
    return prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], lead_tile(*fos_flags))


# ----------------------------------------------------------------------------------------------
# Groups of row blocks
# ----------------------------------------------------------------------------------------------
@triton.jit
def _group_of(rows, offs_ptr, G):
    """Group of each row index in ``rows`` (int32 tensor): the number of group ends <= the row, so
    G for rows past the last group."""
    g = tl.zeros_like(rows)
    for j0 in range(0, G, GC):
        j = j0 + tl.arange(0, GC)
        ends = tl.load(offs_ptr + j, mask=j < G, other=2147483647)
        g += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    return g


@triton.jit
def _group_start(g, offs_ptr, G):
    """First row of groups ``g`` (0 for g = 0 and for g >= G)."""
    return tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < G), other=0)


@triton.jit
def _store_outers(amax_ptr, o_ptr, n, mult, MULT: tl.constexpr, FOS: tl.constexpr):
    """S_dec of the ``n`` amaxes at amax_ptr stored at o_ptr (``rounding.outer_scales``): the
    per-group outer scales, written by one program since a group may have no tile."""
    for j0 in range(0, n, GC):
        j = j0 + tl.arange(0, GC)
        _, s_dec, _ = outer_scales(tl.load(amax_ptr + j, mask=j < n, other=0.0), mult, MULT, FOS)
        tl.store(o_ptr + j, s_dec, mask=j < n)


# ----------------------------------------------------------------------------------------------
# Amax
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fold_groups(acc, m, g, GP: tl.constexpr):
    """acc (GP,) int32 with each group's maximum of m (X,) folded in, g (X,) the groups of m's
    entries (entries of a group >= GP are dropped)."""
    hit = g[:, None] == tl.arange(0, GP)[None, :]
    return tl.maximum(acc, tl.max(tl.where(hit, m[:, None], 0), axis=0))


@autotune(configs=_amax_configs(), key=["M", "K", "ROW", "COL", "COL_RHT", "GP"], prune=_prune())
@triton.jit
def _grouped_amax_kernel(x_ptr, M, K, stride_m, stride_k, offs_ptr, G, signs_ptr, out_ptr, col_off,
                         ROW: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                         GP: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, P: tl.constexpr):
    """Group maxima of |x|, a persistent grid over (16 BB, 16 BC) tiles read as column blocks (16
    tokens of one column in a thread's registers, the blocks of the columnwise copy): ROW per group
    (G,) or per row (M,) from ``out_ptr``; COL of x or of its RHT along the tokens (COL_RHT), per
    group (G,) or per group and column (G, K) from ``out_ptr + col_off``; the fp32 output taken as
    int32 bits (atomic max on the bits), as ``amax._amax_kernel``. Per-group maxima are folded in
    registers, one slot per group (GP >= G slots), and go out with one atomic max per group and
    program at the end: atomics on the same few addresses from every tile measured half the dense
    amax's bandwidth. Per-index maxima take one atomic per element and tile. Token blocks past the
    last group are skipped."""
    row_ptr = out_ptr.to(tl.pointer_type(tl.int32))
    col_ptr = row_ptr + col_off
    signs = tl.load(signs_ptr + tl.arange(0, 16)) if COL_RHT else None
    row_acc = tl.zeros((GP,), dtype=tl.int32)
    col_acc = tl.zeros((GP,), dtype=tl.int32)
    n_k = tl.cdiv(K, 16 * BC)
    for tile in range(tl.program_id(0), tl.cdiv(M, 16 * BB) * n_k, tl.num_programs(0)):
        k = (tile % n_k) * (16 * BC) + tl.arange(0, 16 * BC)
        b = (tile // n_k) * BB + tl.arange(0, BB)
        t = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)  # t[a, d, j] = x[16 b[d] + j, k[a]]
        g = _group_of(16 * b, offs_ptr, G)
        ok = g < G
        tile_max = block_max_bits(t)  # (16 BC, BB)
        if ROW == 1:
            row_acc = _fold_groups(row_acc, tl.max(tile_max, axis=0), g, GP)
        if ROW == 2:
            m = b[:, None] * 16 + tl.arange(0, 16)[None, :]
            tl.atomic_max(row_ptr + m, tl.max(abs_bits(t.to(tl.float32)), axis=0),
                          mask=(m < M) & ok[:, None])
        if COL != 0:
            col_max = tile_max
            if COL_RHT:
                y = t.to(tl.float32)
                col_max = rht_block_max_bits(y, signs, t.dtype, False)
                if tl.max(tl.max(col_max, axis=1), axis=0) >= 0x7F800000:  # Inf or NaN: take again
                    col_max = rht_block_max_bits(y, signs, t.dtype, True)
            if COL == 1:
                col_acc = _fold_groups(col_acc, tl.max(col_max, axis=0), g, GP)
            if COL == 2:
                tl.atomic_max(col_ptr + g[None, :] * K + k[:, None], col_max,
                              mask=ok[None, :] & (k < K)[:, None])
    j = tl.arange(0, GP)
    if ROW == 1:
        tl.atomic_max(row_ptr + j, row_acc, mask=j < G)
    if COL == 1:
        tl.atomic_max(col_ptr + j, col_acc, mask=j < G)


_GROUPED_AMAX = Launcher(_grouped_amax_kernel)


def _amax_mode(spec: Optional[QuantSpec]) -> int:
    if spec is None:
        return NONE
    return PER_INDEX if spec.per_token else PER_GROUP


def _slots(mode: int, n_groups: int, n_index: int) -> int:
    """Values an amax output of ``mode`` holds: none, one per group, or ``n_index``."""
    return 0 if mode == NONE else n_groups if mode == PER_GROUP else n_index


def grouped_amax_pass(x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec],
                      col: Optional[QuantSpec], signs: Optional[torch.Tensor] = None):
    """The amaxes :func:`quantize_grouped` needs for copies ``row`` and ``col`` of x, from one read:
    (row amax or None, column amax or None), fp32 device tensors before any amax_scale factor: row
    (G,) per group or (M,) per row; column (G,) or (G, K), of the RHT along the tokens when
    ``col.rht`` without amax_scale. Groups without tokens have amax 0."""
    m, k = x.shape
    n_groups = offs.shape[0]
    col_rht = bool(col and col.rht and col.amax_scale is None)
    r_mode, c_mode = _amax_mode(row), _amax_mode(col)
    shared = r_mode == PER_GROUP and c_mode == PER_GROUP and not col_rht
    if shared:  # one per-group amax of x serves both copies
        c_mode = NONE
    n_row, n_col = _slots(r_mode, n_groups, m), _slots(c_mode, n_groups, n_groups * k)
    out = torch.zeros(n_row + n_col, dtype=torch.float32, device=x.device)
    sms = num_sms(x.device)
    grid = lambda meta: (min(cdiv(m, 16 * meta["BB"]) * cdiv(k, 16 * meta["BC"]),
                             sms * meta["P"]),)
    if m and k and n_groups:
        _GROUPED_AMAX[grid](x, m, k, x.stride(0), x.stride(1), offs, n_groups,
                                   signs if col_rht else out, out, n_row,
                                   ROW=r_mode, COL=c_mode, COL_RHT=col_rht,
                                   GP=next_pow2(n_groups))
    row_amax = out[:n_row] if row else None
    col_amax = out[n_row:].view(n_groups, k) if c_mode == PER_INDEX else out[n_row:]
    if shared:
        col_amax = row_amax if row else None
    return row_amax, (col_amax if col else None)


# ----------------------------------------------------------------------------------------------
# Quantization of token groups
# ----------------------------------------------------------------------------------------------
@autotune(configs=_configs(), key=["M", "K", "ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_MULT",
                                    "ROW_INNER", "COL", "COL_RHT", "COL_SR", "COL_PER_TOKEN",
                                    "COL_MULT", "COL_INNER", "ROW_FOS", "COL_FOS", "DEQ", "D_R",
                                    "D_KB"],
          prune=_prune("ROW_FOS", "COL_FOS"))
@triton.jit
def _quantize_grouped_kernel(x_ptr, M, K, stride_m, stride_k, offs_ptr, G, signs_ptr, seed_arg,
                             mul16, rq_ptr, rs_ptr, ro_ptr, ramax_ptr, r_mult, roff_arg,
                             cq_ptr, cs_ptr, co_ptr, camax_ptr, c_mult, coff_arg,
                             dq_ptr, ds_ptr, dout_ptr, D_R, D_KB, d_stride_q, d_stride_s,
                             d_stride_o, ROW: tl.constexpr, ROW_SR: tl.constexpr, ROW_PER_TOKEN: tl.constexpr,
                             ROW_MULT: tl.constexpr, ROW_INNER: tl.constexpr, COL: tl.constexpr,
                             COL_RHT: tl.constexpr, COL_SR: tl.constexpr,
                             COL_PER_TOKEN: tl.constexpr, COL_MULT: tl.constexpr,
                             COL_INNER: tl.constexpr, ROW_FOS: tl.constexpr,
                             COL_FOS: tl.constexpr, SEED_PTR: tl.constexpr,
                             ROFF_PTR: tl.constexpr, COFF_PTR: tl.constexpr, DEQ: tl.constexpr,
                             D_BLOCK_2D: tl.constexpr, D_BR: tl.constexpr, D_H: tl.constexpr,
                             D_EVEN_K: tl.constexpr, D_PTX: tl.constexpr,
                             BB: tl.constexpr, BC: tl.constexpr):
    """One (16 BB, 16 BC) tile of x a program: its rowwise copy from the (16 BB, BC, 16) row
    blocks, its columnwise copy from the (16 BC, BB, 16) column blocks (read again: L1/L2 hits),
    each block with the outer scale of its group (or token). The per-group outer scales are
    written by program (0, 0) (a group may have no tile), per-token ones by the programs holding
    the first column (rowwise) or the first row (columnwise) of a tile column. With DEQ each
    program then takes its share of another operand's dequantize pass
    (``quantize.ride_dequantize``, as in the dense pair kernel)."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    seed = scalar_arg(seed_arg, SEED_PTR)
    first = (pid_b == 0) & (pid_c == 0)
    b = pid_b * BB + tl.arange(0, BB)  # token blocks
    m = pid_b * (16 * BB) + tl.arange(0, 16 * BB)  # x (M, K): rows m, block columns c
    c = pid_c * BC + tl.arange(0, BC)
    if ROW:  # the tile's load first: the group and scale lookups below are dependent loads
        y = load_row_blocks(x_ptr, m, c, M, K, stride_m, stride_k)
    g = _group_of(16 * b, offs_ptr, G)
    if ROW:
        g_m = tl.reshape(tl.broadcast_to(g[:, None], (BB, 16)), (16 * BB,))
        if ROW_PER_TOKEN:
            s_enc6, s_dec, amax = outer_scales(tl.load(ramax_ptr + m, mask=m < M, other=0.0),
                                               r_mult, ROW_MULT, ROW_FOS)
            if pid_c == 0:
                tl.store(ro_ptr + m, s_dec, mask=(m < M) & (g_m < G))
        else:
            s_enc6, s_dec, amax = outer_scales(tl.load(ramax_ptr + g_m, mask=g_m < G, other=0.0),
                                               r_mult, ROW_MULT, ROW_FOS)
            if first:
                _store_outers(ramax_ptr, ro_ptr, G, r_mult, ROW_MULT, ROW_FOS)
        rows = tl.where(g_m < G, m, M)  # rows past the last group: stores masked off
        _quantize_store(y.to(tl.float32), rows[:, None], c[None, :], M, K, rq_ptr, rs_ptr,
                        s_enc6[:, None], s_dec[:, None], amax[:, None], seed,
                        scalar_arg(roff_arg, ROFF_PTR), mul16, ROW_SR, ROW_INNER, ROW_FOS)
    if COL:  # x^T (K, M): rows k, block columns b, group g of x_g^T (K, M_g)
        k = pid_c * (16 * BC) + tl.arange(0, 16 * BC)
        y = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)
        start = _group_start(g, offs_ptr, G)
        n_g = (tl.load(offs_ptr + g, mask=g < G, other=0) - start) // 16  # blocks in the group
        if COL_PER_TOKEN:
            idx = g[None, :] * K + k[:, None]
            amax = tl.load(camax_ptr + idx, mask=(g < G)[None, :] & (k < K)[:, None], other=0.0)
            s_enc6, s_dec, amax = outer_scales(amax, c_mult, COL_MULT, COL_FOS)  # (16 BC, BB)
            if pid_b == 0:
                for g0 in range(0, G, GC):
                    gg = g0 + tl.arange(0, GC)
                    o_idx = gg[:, None] * K + k[None, :]
                    o_mask = (gg < G)[:, None] & (k < K)[None, :]
                    _, o, _ = outer_scales(tl.load(camax_ptr + o_idx, mask=o_mask, other=0.0),
                                           c_mult, COL_MULT, COL_FOS)
                    tl.store(co_ptr + o_idx, o, mask=o_mask)
        else:
            s_enc6, s_dec, amax = outer_scales(tl.load(camax_ptr + g, mask=g < G, other=0.0),
                                               c_mult, COL_MULT, COL_FOS)
            s_enc6, s_dec, amax = s_enc6[None, :], s_dec[None, :], amax[None, :]
            if first:
                _store_outers(camax_ptr, co_ptr, G, c_mult, COL_MULT, COL_FOS)
        if COL_RHT:
            yf = round_to(rht16(y.to(tl.float32), tl.load(signs_ptr + tl.arange(0, 16))), y.dtype)
        else:
            yf = y.to(tl.float32)
        # Group g's counter of block (k, b) is col_offset + start/16 * K + k * n_g + (b - start/16)
        # (its dense copy's, module docstring); _quantize_store adds the block's index in the
        # (K, M/16) grid of all groups, k * (M/16) + b, so the offset passed takes it back off
        # (uint32 arithmetic wraps as the Philox counter does).
        s16 = _u32(start // 16)[None, :]
        off = (_u32(scalar_arg(coff_arg, COFF_PTR)) + s16 * _u32(K) - s16
               + _u32(k[:, None]) * (_u32(n_g) - _u32(M // 16))[None, :])
        blocks = tl.where(g < G, b, M // 16)  # token blocks past the last group: masked off
        _quantize_store(yf, k[:, None], blocks[None, :], K, M, cq_ptr, cs_ptr, s_enc6, s_dec, amax,
                        seed, off, mul16, COL_SR, COL_INNER, COL_FOS)
    if DEQ:
        ride_dequantize(dq_ptr, ds_ptr, dout_ptr, D_R, D_KB, d_stride_q, d_stride_s, d_stride_o,
                        D_BLOCK_2D, D_BR, D_H, D_EVEN_K, D_PTX)


_QUANTIZE_GROUPED = Launcher(_quantize_grouped_kernel)


def check_offsets(offs: torch.Tensor, device: torch.device) -> None:
    """Raise unless ``offs`` is a 1-D int32 tensor on ``device`` (its values, nondecreasing
    multiples of 16 ending at most at the number of rows, are the caller's contract: checking them
    would synchronise with the host; ``backends.grouped.check_offsets`` does)."""
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"offs must be a 1-D int32 tensor of cumulative group ends, got "
                        f"{getattr(offs, 'dtype', type(offs).__name__)} "
                        f"{tuple(getattr(offs, 'shape', ()))}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, the data on {device}")


def quantize_grouped(x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec] = None,
                     col: Optional[QuantSpec] = None, *, inner: Tuple[bool, bool] = (False, False),
                     seed: IntOrTensor = 0, row_offset: IntOrTensor = 0,
                     col_offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                     amaxes: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                     dequantize: Optional[Tuple[NVFP4Operand, torch.Tensor]] = None,
                     ) -> Tuple[Optional[GroupedOperand], Optional[GroupedOperand]]:
    """Grouped 1D NVFP4 quantization of the token groups of x: both copies from one read (plus the
    amax pass), one outer scale per group (or per token).

    Args:
        x: (M, K) bfloat16/float16/float32, any strides, M and K multiples of 16.
        offs: int32 (G,) cumulative group ends on x's device; each group's length a multiple of
            16, ``offs[-1] <= M`` (not checked here: that needs the host).
        row: the rowwise copy (blocks along K; 1d, no RHT), or None.
        col: the columnwise copy (each group's x_g^T, blocks of 16 tokens; 1d, RHT allowed), or None.
        inner: per copy, write fp16 inner values (codes x block scales, exact) instead of codes
            and scales, for a GEMM that uses the copy at once.
        seed, row_offset, col_offset: the SR streams (module docstring); ints or device scalars.
        signs: (16,) +-1 RHT signs (needed when ``col.rht``).
        amaxes: the (row, column) amaxes as :func:`grouped_amax_pass` returns them for these specs,
            to skip the amax pass (benchmarks time the two passes apart).
        dequantize: (op, out): another 2-D operand with codes whose inner values the same launch
            writes into out, as ``quantize.quantize_1d(dequantize=...)`` (only with a columnwise
            copy; the experts' W^T of dgrad rides on dY's pass).
    Returns:
        (rowwise, columnwise) :class:`GroupedOperand` or None, whose data carries ``row`` /
        ``col`` as its spec: rowwise data qdata (M, K/2), scale
        (M, K/16), outer (G,) or (M,); columnwise data qdata (K, M/2), scale (K, M/16), outer (G,)
        or (G, K). Rows past ``offs[-1]`` are left unwritten.
    Raises:
        TypeError: dtype of x or offs. ValueError: shapes, 2d or rowwise-RHT specs, an RHT
            without signs, inner values on a GPU without E4M3 conversion, ``dequantize``
            without a columnwise copy or with operands ``quantize.dequantize_job`` refuses.
    Source: spec items 1-10 of docs/numerics.md per group (``reference.quantize`` on each group).
    """
    for spec, name in ((row, "row"), (col, "col")):
        if spec is not None and spec.block is not Block.D1:
            raise ValueError(f"quantize_grouped makes 1d copies; {name} has {spec.block.value} blocks")
    if row is not None and row.rht:
        raise ValueError("the rowwise copy of token groups takes no RHT (the recipe applies it to "
                         "the wgrad copies, along the tokens)")
    if col is not None and col.rht and signs is None:
        raise ValueError("an RHT copy needs the 16 RHT signs")
    check_matrix(x, rows16=True, cols16=True)
    check_offsets(offs, x.device)
    check_runnable(x.device)
    check_inner(any(inner), x.device)
    if dequantize is not None and col is None:
        raise ValueError("dequantize runs in the pass that writes a columnwise copy; there is none")
    (m, k), n_groups, dev = x.shape, offs.shape[0], x.device
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if col and col.rht else x
    row_amax, col_amax = amaxes if amaxes is not None else grouped_amax_pass(x, offs, row, col,
                                                                             signs_t)
    r = empty_copy(m, k, row, inner[0], (m,) if row.per_token else (n_groups,), dev) \
        if row else None
    c = empty_copy(k, m, col, inner[1], (n_groups, k) if col.per_token else (n_groups,), dev) \
        if col else None
    seed_a, seed_p = scalar(seed, dev)
    roff_a, roff_p = scalar(row_offset, dev)
    coff_a, coff_p = scalar(col_offset, dev)
    dummy = x
    d_args, d_consts = dequantize_job(dequantize, dummy)
    grid = lambda meta: (max(1, cdiv(m, 16 * meta["BB"])), cdiv(k, 16 * meta["BC"]))
    if k and (row or col):
        _QUANTIZE_GROUPED[grid](
            x, m, k, x.stride(0), x.stride(1), offs, n_groups, signs_t, seed_a, 16,
            *(_pointers(r) if r else (dummy, dummy)), r.outer_scale if r else dummy,
            row_amax if r else dummy, float(row.amax_scale or 1.0) if r else 1.0, roff_a,
            *(_pointers(c) if c else (dummy, dummy)), c.outer_scale if c else dummy,
            col_amax if c else dummy, float(col.amax_scale or 1.0) if c else 1.0, coff_a, *d_args,
            DEQ=dequantize is not None, **d_consts, ROW=r is not None, ROW_SR=bool(row and row.sr),
            ROW_PER_TOKEN=bool(row and row.per_token),
            ROW_MULT=bool(row and row.amax_scale is not None), ROW_INNER=bool(row and inner[0]),
            COL=c is not None, COL_RHT=bool(col and col.rht), COL_SR=bool(col and col.sr),
            COL_PER_TOKEN=bool(col and col.per_token),
            COL_MULT=bool(col and col.amax_scale is not None), COL_INNER=bool(col and inner[1]),
            ROW_FOS=fos_code(row.four_over_six) if row else 0,
            COL_FOS=fos_code(col.four_over_six) if col else 0,
            SEED_PTR=seed_p, ROFF_PTR=roff_p, COFF_PTR=coff_p)
    rows = GroupedOperand(_finished(r), offs, False, row.per_token) if r else None
    cols = GroupedOperand(_finished(c), offs, True, col.per_token) if c else None
    return rows, cols


# ----------------------------------------------------------------------------------------------
# Expert weights
# ----------------------------------------------------------------------------------------------
@autotune(configs=_configs(), key=["N", "K", "W", "WT", "SR", "MULT", "INNER", "FOS"],
          prune=_prune("FOS"))
@triton.jit
def _experts_2d_kernel(w_ptr, N, K, stride_g, stride_n, stride_k, amax_ptr, mult, seed_arg, off_arg,
                       mul16, q_ptr, s_ptr, qt_ptr, st_ptr, o_ptr,
                       W: tl.constexpr, WT: tl.constexpr, SR: tl.constexpr, MULT: tl.constexpr,
                       INNER: tl.constexpr, FOS: tl.constexpr, SEED_PTR: tl.constexpr,
                       OFF_PTR: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """``quantize.quantize_2d_tile`` of expert program_id(2)'s W_g (N, K), with its own amax and
    outer scale and the SR counter base off + g * N * K / 16; W and W^T are stacked per expert
    (W's inner values too, with INNER)."""
    g = tl.program_id(2).to(tl.int64)
    words = (N // 16) * K  # int64 words of one expert's codes, W_g (N, K/2 bytes) or W_g^T
    scales = (N // 16) * (K // 16)
    off = _u32(scalar_arg(off_arg, OFF_PTR)) + _u32(g) * _u32(words)
    q_g = q_ptr + g * (16 * words if INNER else words)  # N K float16 inner values per expert
    quantize_2d_tile(w_ptr + g * stride_g, N, K, stride_n, stride_k, amax_ptr + g, mult,
                     scalar_arg(seed_arg, SEED_PTR), off, mul16, q_g, s_ptr + g * scales,
                     qt_ptr + g * words, st_ptr + g * scales, o_ptr + g,
                     tl.program_id(0), tl.program_id(1), W, WT, SR, MULT, INNER, FOS, BB, BC)


_EXPERTS_2D = Launcher(_experts_2d_kernel)


def expert_offsets(groups: int, rows: int, device) -> torch.Tensor:
    """int32 (groups,) ends of ``groups`` groups of ``rows`` rows each: the experts of a stacked
    (G * rows, K) weight as token groups."""
    return torch.arange(1, groups + 1, dtype=torch.int32, device=device) * rows


def quantize_experts(w: torch.Tensor, spec: QuantSpec, *, write_w: bool = True,
                     write_wt: bool = True, seed: IntOrTensor = 0, offset: IntOrTensor = 0,
                     inner: bool = False,
                     ) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand]]:
    """Expert weights (G, N, K) quantized per expert, each with its own per-tensor outer scale.

    2d blocks: W_g and its exact transpose from one read (``quantize_2d`` per expert, one launch).
    1d blocks: W_g along K and W_g^T along N, each a :func:`quantize_grouped` rowwise copy of the
    stacked experts (W^T from a transposed copy of w).

    Args:
        w: (G, N, K) bfloat16/float16/float32, N and K multiples of 16.
        spec: a per-tensor spec without RHT (rounding and amax_scale apply).
        write_w, write_wt: which of W and W^T to return.
        seed, offset: the SR stream; expert g's counter base is offset + g * N * K / 16.
        inner: write W as its inner values (codes x block scales, float16, exact) instead of
            codes and scales, for a GEMM that uses W at once (no dequantize pass).
    Returns:
        (W, W^T) :class:`NVFP4Operand` (both carrying ``spec``) or None: qdata (G, N, K/2) /
        (G, K, N/2), scale
        (G, N/16, K/16) / (G, K/16, N/16) for 2d, (G, N, K/16) / (G, K, N/16) for 1d, outer (G,);
        with ``inner``, W has values (G, N, K) float16 instead.
    Raises:
        TypeError: dtype. ValueError: shape, a per-token or RHT spec, ``inner`` on a GPU without
            E4M3 conversion (before sm89).
    """
    if spec.per_token or spec.rht:
        raise ValueError(f"expert weights take a per-tensor spec without RHT, got {spec}")
    if w.dim() != 3:
        raise ValueError(f"expert weights must be (G, N, K), got shape {tuple(w.shape)}")
    n_groups, n, k = w.shape
    check_matrix(w.reshape(n_groups * n, k), rows16=False, cols16=True)
    if n % 16:
        raise ValueError(f"expert weights need N (dimension 1) a multiple of 16, got shape "
                         f"{tuple(w.shape)}")
    check_runnable(w.device)
    check_inner(inner and write_w, w.device)
    if spec.block is Block.D1:
        return _experts_1d(w, spec, write_w, write_wt, seed, offset, inner)
    dev = w.device
    w2 = w.reshape(n_groups * n, k)
    amax = grouped_amax_pass(w2, expert_offsets(n_groups, n, dev), spec, None)[0]
    wq, wtq, outer = empty_2d((n_groups,), n, k, spec, write_w, write_wt, inner, dev)
    seed_a, seed_p = scalar(seed, dev)
    off_a, off_p = scalar(offset, dev)
    grid = lambda meta: (cdiv(n, 16 * meta["BB"]), cdiv(k, 16 * meta["BC"]), n_groups)
    if w.numel():
        _EXPERTS_2D[grid](
            w, n, k, w.stride(0), w.stride(1), w.stride(2), amax, float(spec.amax_scale or 1.0),
            seed_a, off_a, 16, *(_pointers(wq) if wq else (w, w)),
            *(_pointers(wtq) if wtq else (w, w)), outer,
            W=write_w, WT=write_wt, SR=spec.sr, MULT=spec.amax_scale is not None,
            INNER=bool(inner and write_w), FOS=fos_code(spec.four_over_six), SEED_PTR=seed_p,
            OFF_PTR=off_p)
    return (_finished(wq) if wq else None), (_finished(wtq) if wtq else None)


def _experts_1d(w, spec, write_w, write_wt, seed, offset, inner):
    """:func:`quantize_experts` with 1d blocks: rowwise grouped copies of the stacked experts."""
    n_groups, n, k = w.shape

    def stacked(t, rows, cols, inner_):
        offs = expert_offsets(n_groups, rows, t.device)
        op = quantize_grouped(t.reshape(n_groups * rows, cols), offs, spec, seed=seed,
                              row_offset=offset, inner=(inner_, False))[0].data
        if op.form is Form.VALUES:
            return op._replace(values=op.values.reshape(n_groups, rows, cols))
        return op._replace(qdata=op.qdata.reshape(n_groups, rows, cols // 2),
                           scale=op.scale.reshape(n_groups, rows, cols // 16))

    wq = stacked(w, n, k, inner) if write_w else None
    wtq = stacked(w.transpose(1, 2).contiguous(), k, n, False) if write_wt else None
    return wq, wtq


# ----------------------------------------------------------------------------------------------
# Grouped GEMM
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dot_range(a_ptr, b_ptr, offs_m, offs_n, m_end, N, k_start, k_end, stride_am, stride_ak,
               stride_bn, stride_bk, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               INTERP: tl.constexpr):
    """sum over k in [k_start, k_end) of A[offs_m, k] * B[offs_n, k] as an fp32 (BM, BN) tile; rows
    at or past m_end and columns at or past N read as zero."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(offs_m < m_end)[:, None] & (kk < k_end)[None, :], other=0.0)
        b = tl.load(b_ptr + kk.to(tl.int64)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(kk < k_end)[:, None] & (offs_n < N)[None, :], other=0.0)
        acc = _mma(a, b, acc, INTERP)
    return acc


@triton.jit
def _dot_range_tma(a_desc, b_desc, row_a, row_b, k_start, k_end, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr, INTERP: tl.constexpr):
    """:func:`_dot_range` through TMA descriptors: rows [row_a, row_a + BM) of A and [row_b, row_b
    + BN) of B (reads past a descriptor's edge are zero; rows of a neighbouring group are left to
    the store's mask). With MASK_K (k_end inside the matrix: the next group's tokens follow) the
    main loop takes the whole BK steps and one more step, if any columns are left, zeroes those at
    or past k_end in registers, in both operands (a non-finite value times zero would not vanish).
    Masking only that step keeps the main loop's tiles in shared memory for the MMA: masking every
    step measured twice the time of the grouped wgrad."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    full_end = k_end
    if MASK_K:
        full_end = k_start + (k_end - k_start) // BK * BK
    for k0 in range(k_start, full_end, BK):
        acc = _mma(a_desc.load([row_a, k0]), b_desc.load([row_b, k0]).T, acc, INTERP)
    if MASK_K:
        if full_end < k_end:
            keep = (full_end + tl.arange(0, BK) < k_end)[None, :]
            a = tl.where(keep, a_desc.load([row_a, full_end]), 0.0)
            b = tl.where(keep, b_desc.load([row_b, full_end]), 0.0)
            acc = _mma(a, b.T, acc, INTERP)
    return acc


@triton.jit(do_not_specialize=["sa_g", "sa_m", "sb_g", "sb_n"])
def _grouped_gemm_kernel(a_ptr, b_ptr, offs_ptr, sa_ptr, sb_ptr, out_ptr, G, M, N, K,
                         stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_og,
                         stride_om, sa_g, sa_m, sb_g, sb_n, ALONG_K: tl.constexpr,
                         TMA: tl.constexpr, INTERP: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                         NUM_PROGRAMS: tl.constexpr):
    """A persistent grouped GEMM: every program walks the groups and takes every NUM_PROGRAMS-th
    output tile of all of them, so no group sizes are needed on the host. With TMA, a_ptr and
    b_ptr are TMA descriptors of A and of B as a 2-D matrix (the experts' (G N, K) in rows mode;
    the strides are then unused), else pointers.

    Rows mode (not ALONG_K; fprop, dgrad): out[r] = s_a * s_b[g] * A[r] . B_g for the rows r of
    group g, A (T, K), B_g at b_ptr + g * stride_bg, (N, K) with the given strides; K is the
    reduction; M = T, whose rows past the last group get zeros. ALONG_K (wgrad): out_g (M, N) =
    s_a * s_b * A[:, grp] . B[:, grp] over the group's token range of A (M, T) and B (N, T).
    Outer scales of group g are at sa_ptr + g * sa_g, one per row (sa_m = 1) or shared (sa_m =
    0); likewise for B. Epilogue in fp32, rounded once."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    done = 0  # output tiles of the groups before g
    start = 0
    b_g = b_ptr  # group g's B and output, advanced per group (no g * stride product to overflow)
    out_g = out_ptr
    for g in range(G):
        end = tl.load(offs_ptr + g)
        if ALONG_K:
            rows = M
        else:
            rows = end - start
        tiles = tl.cdiv(rows, BM) * tiles_n
        first = done + (pid + NUM_PROGRAMS - done % NUM_PROGRAMS) % NUM_PROGRAMS
        for t in range(first, done + tiles, NUM_PROGRAMS):
            pid_m, pid_n = _tile_pid(t - done, rows, N, BM, BN, GROUP_M)
            offs_n = pid_n * BN + tl.arange(0, BN)
            if ALONG_K:
                offs_m = pid_m * BM + tl.arange(0, BM)
                if TMA:
                    acc = _dot_range_tma(a_ptr, b_ptr, pid_m * BM, pid_n * BN, start, end, BM, BN,
                                         BK, True, INTERP)
                else:
                    acc = _dot_range(a_ptr, b_g, offs_m, offs_n, M, N, start, end, stride_am,
                                     stride_ak, stride_bn, stride_bk, BM, BN, BK, INTERP)
                m_end = M
            else:
                offs_m = start + pid_m * BM + tl.arange(0, BM)
                if TMA:
                    acc = _dot_range_tma(a_ptr, b_ptr, start + pid_m * BM, g * N + pid_n * BN, 0,
                                         K, BM, BN, BK, False, INTERP)
                else:
                    acc = _dot_range(a_ptr, b_g, offs_m, offs_n, end, N, 0, K, stride_am,
                                     stride_ak, stride_bn, stride_bk, BM, BN, BK, INTERP)
                m_end = end
            _epilogue(acc, offs_m, offs_n, m_end, N, sa_ptr + g * sa_g, sb_ptr + g * sb_g, sa_ptr,
                      out_g, sa_m, sb_n, stride_om, False)
        done += tiles
        start = end
        if not TMA:  # (the descriptor is indexed by row instead)
            b_g += stride_bg
        out_g += stride_og
    if not ALONG_K:  # rows past the last group: zeros (M = T here)
        first = done + (pid + NUM_PROGRAMS - done % NUM_PROGRAMS) % NUM_PROGRAMS
        for t in range(first, done + tl.cdiv(M - start, BM) * tiles_n, NUM_PROGRAMS):
            offs_m = start + ((t - done) // tiles_n) * BM + tl.arange(0, BM)
            offs_n = ((t - done) % tiles_n) * BN + tl.arange(0, BN)
            tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                     tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty),
                     mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# BM, BN, BK, GROUP_M, num_warps, num_stages; P programs per SM: the fastest of
# benchmarks/bench_moe.py --sweep for all three GEMMs on an H200 (docs/moe.md); the interpreter
# takes one small config.
GROUPED_GEMM_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, P=1)
_INTERP_GROUPED_GEMM_CONFIG = dict(BM=32, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1, P=1)


def stacked_codes(op: NVFP4Operand) -> NVFP4Operand:
    """The codes of a stacked per-expert operand (qdata (G, R, C/2)) as one (G R, C) operand with
    no outer scale (and op's spec), for a dequantize pass of all experts to inner values."""
    n_groups, rows, half = op.qdata.shape
    return NVFP4Operand(op.qdata.reshape(n_groups * rows, half), op.scale.flatten(0, 1), None,
                        op.spec)


def expert_inner(op: NVFP4Operand) -> torch.Tensor:
    """The fp16 inner values (G, R, C) of a stacked per-expert operand (qdata (G, R, C/2)): its own,
    or one dequantize pass of all experts as one (G R, C) matrix."""
    if op.form is Form.VALUES:
        return op.values
    n_groups, rows, half = op.qdata.shape
    return dequantize_inner(stacked_codes(op), torch.float16).view(n_groups, rows, 2 * half)


def _inner(op: NVFP4Operand) -> torch.Tensor:
    """The fp16 inner values of a 2-D operand (one dequantize pass unless it has them)."""
    if op.form is Form.VALUES:
        return op.values
    return dequantize_inner(op, torch.float16)


def _outer_shape(op: GroupedOperand) -> Tuple[int, ...]:
    """The outer-scale shape of a grouped operand (``operand.GroupedOperand``)."""
    if not op.per_token:
        return (op.groups,)
    return (op.groups, op.data.rows) if op.along_k else (op.data.rows,)


def _check_outer_scales(a: GroupedOperand, b: Union[NVFP4Operand, GroupedOperand]) -> None:
    """Raises ValueError unless the outer scales have the shapes the kernel reads (one fp32 value
    per group, or per row as ``per_token`` says) and the offsets suit the kernel."""
    check_offsets(a.offs, a.data.device)
    want = [("A", a.data.outer_scale, _outer_shape(a))]
    if isinstance(b, GroupedOperand):
        want.append(("B", b.data.outer_scale, _outer_shape(b)))
    else:
        want.append(("B", b.outer_scale, (a.groups,)))
    for name, outer, shape in want:
        if outer.dtype != torch.float32 or tuple(outer.shape) != shape or not outer.is_contiguous():
            raise ValueError(f"{name}'s outer scale must be a contiguous float32 {shape}, got "
                             f"{outer.dtype} {tuple(outer.shape)} with strides {outer.stride()}")


def _scale_strides(op: GroupedOperand) -> Tuple[int, int]:
    """(stride per group, stride per row) of a grouped operand's outer scales."""
    if not op.per_token:
        return 1, 0
    return (op.data.rows, 1) if op.along_k else (0, 1)


METHODS = ("tma", "pointers")


def default_method(device: torch.device) -> str:
    """"tma" (operands read through TMA descriptors, pipelined) on sm90+, "pointers" (masked
    loads) before sm90 and under the interpreter."""
    tma = device.type == "cuda" and not interpreting() and capability(device) >= (9, 0)
    return "tma" if tma else "pointers"


def grouped_scaled_mm(a: GroupedOperand, b: Union[NVFP4Operand, GroupedOperand], *,
                      out_dtype: torch.dtype = torch.bfloat16, cfg: Optional[dict] = None,
                      method: str = "auto") -> torch.Tensor:
    """The grouped NVFP4 GEMM, ``backends.grouped.reference_mm``'s semantics, on 16-bit inner
    values (a dequantize pass for operands given as codes) with fp32 accumulation.

    Args:
        a: fprop/dgrad: rows-grouped A (T, K), outer (G,) or (T,). wgrad: A^T grouped along K,
            data (M, T), outer (G,) or (G, M).
        b: fprop/dgrad: the experts' B, an :class:`NVFP4Operand` (G, N, K) (codes or inner
            values), outer (G,). wgrad: grouped along K, data (N, T), outer (G,) or (G, N).
        out_dtype: bfloat16, float16 or float32. cfg: a tile config (benchmarks).
        method: "auto" (:func:`default_method`), "tma" or "pointers": how the kernel reads the
            inner values (same results).
    Returns:
        fprop/dgrad: (T, N), zeros in the rows past ``offs[-1]``. wgrad: (G, M, N). Products exact,
        sums in fp32, outer scales applied in fp32, one rounding to ``out_dtype``.
    Raises:
        TypeError: ``out_dtype``; offsets not int32. ValueError: operands of the wrong layouts or
            sizes, outer scales of the wrong shape or dtype, an unknown method.
    """
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    cfg = dict(cfg or (_INTERP_GROUPED_GEMM_CONFIG if interpreting() else GROUPED_GEMM_CONFIG))
    dev = a.data.device
    check_runnable(dev)
    method = default_method(dev) if method == "auto" else method
    if method not in METHODS:
        raise ValueError(f"method must be 'auto' or one of {METHODS}, got {method!r}")
    n_groups = a.groups
    a_in = _inner(a.data)
    if isinstance(b, GroupedOperand):
        out, args = _wgrad_args(a, a_in, b, out_dtype, dev)
        tiles = n_groups * cdiv(out.shape[1], cfg["BM"]) * cdiv(out.shape[2], cfg["BN"])
    else:
        out, args = _rows_args(a, a_in, b, out_dtype, dev)
        tiles = (cdiv(out.shape[0], cfg["BM"]) + n_groups + 1) * cdiv(out.shape[1], cfg["BN"])
    _check_outer_scales(a, b)  # (after the layouts, whose errors say more)
    if out.numel() == 0:
        return out.to(out_dtype)
    programs = max(1, min(num_sms(dev) * cfg.pop("P", 1), tiles))
    sa_g, sa_m = _scale_strides(a)
    b_mat = args["b_ptr"] if a.along_k else args["b_ptr"].reshape(-1, args["K"])
    if method == "tma" and a_in.numel() and b_mat.numel():  # (no descriptor of an empty matrix)
        from triton.tools.tensor_descriptor import TensorDescriptor
        args.update(a_ptr=TensorDescriptor.from_tensor(args["a_ptr"], [cfg["BM"], cfg["BK"]]),
                    b_ptr=TensorDescriptor.from_tensor(b_mat, [cfg["BN"], cfg["BK"]]))
    _grouped_gemm_kernel[(programs,)](**args, sa_g=sa_g, sa_m=sa_m, ALONG_K=a.along_k,
                                      TMA=not isinstance(args["a_ptr"], torch.Tensor),
                                      INTERP=interpreting(),
                                      NUM_PROGRAMS=programs, **cfg)
    return out.to(out_dtype)


def _rows_args(a: GroupedOperand, a_in, b: NVFP4Operand, out_dtype, dev):
    """(out (T, N), kernel keyword arguments) of fprop/dgrad: A grouped by rows, B (G, N, K) per expert."""
    held = b.values if b.form is Form.VALUES else b.qdata
    if a.along_k or held is None or held.dim() != 3:
        raise ValueError("fprop/dgrad take A grouped by rows and B as (G, N, K) expert operands")
    b_in = expert_inner(b)
    (t, k), (n_b, n, k_b) = a_in.shape, b_in.shape
    if n_b != a.groups or k_b != k:
        raise ValueError(f"A is ({t}, {k}) in {a.groups} groups, B is ({n_b}, {n}, {k_b})")
    out = _kernel_out(t, n, out_dtype, dev)
    args = dict(a_ptr=a_in, b_ptr=b_in, offs_ptr=a.offs, sa_ptr=a.data.outer_scale,
                sb_ptr=b.outer_scale, out_ptr=out, G=a.groups, M=t, N=n, K=k,
                stride_am=a_in.stride(0), stride_ak=a_in.stride(1), stride_bg=b_in.stride(0),
                stride_bn=b_in.stride(1), stride_bk=b_in.stride(2), stride_og=0,
                stride_om=out.stride(0), sb_g=1, sb_n=0)
    return out, args


def _wgrad_args(a: GroupedOperand, a_in, b: GroupedOperand, out_dtype, dev):
    """(out (G, M, N), kernel keyword arguments) of wgrad: A (M, T) and B (N, T) grouped along T."""
    if not (a.along_k and b.along_k) or b.groups != a.groups or b.data.k != a.data.k:
        raise ValueError("wgrad operands must both be grouped along K (the tokens), with the same "
                         f"groups: A ({a.data.rows}, {a.data.k}) in {a.groups}, B "
                         f"({b.data.rows}, {b.data.k}) in {b.groups}")
    b_in = _inner(b.data)
    m, n = a_in.shape[0], b_in.shape[0]
    out = _kernel_out(a.groups * m, n, out_dtype, dev).view(a.groups, m, n)
    sb_g, sb_n = _scale_strides(b)
    args = dict(a_ptr=a_in, b_ptr=b_in, offs_ptr=a.offs, sa_ptr=a.data.outer_scale,
                sb_ptr=b.data.outer_scale, out_ptr=out, G=a.groups, M=m, N=n, K=0,
                stride_am=a_in.stride(0), stride_ak=a_in.stride(1), stride_bg=0,
                stride_bn=b_in.stride(0), stride_bk=b_in.stride(1), stride_og=out.stride(0),
                stride_om=out.stride(1), sb_g=sb_g, sb_n=sb_n)
    return out, args

"""Grouped NVFP4 quantization of token groups for mixture-of-experts layers.

The tokens of all experts form one (T, K) matrix split into G groups by ``offs`` (``groups``;
docs/moe.md). :func:`quantize_grouped` takes one amax pass (``grouped_amax.grouped_amax_pass``)
then one launch that writes, from one read of x, the rowwise copy (blocks along K) and the
columnwise copy (each group's x_g^T, blocks of 16 tokens, optionally through the RHT along the
tokens), each with RN or SR and an outer scale per group or per token. Group g's bits equal
``reference.quantize`` called on that group alone with the SR counter bases below
(tests/test_kernels_grouped.py). Rows past ``offs[-1]`` are neither quantized nor read.

SR streams, per group (docs/moe.md): the rowwise copy of group g is the dense quantization of x_g
with counter base ``row_offset + start_g * K / 16``, i.e. the counters of the whole matrix's dense
rowwise copy; the columnwise copy of group g is that of x_g^T (K, M_g) with counter base
``col_offset + start_g * K / 16``, so the groups take disjoint ranges covering the dense copy's.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..operand import GroupedOperand, NVFP4Operand
from ..spec import Block, QuantSpec
from .amax import check_matrix
from .four_over_six import four_over_six_constexprs, four_over_six_names, lead_tile
from .grouped_amax import grouped_amax_pass
from .groups import GROUPS_PER_STEP, check_offsets, group_of, group_start
from .hadamard import rht16
from .quantize import (IntOrTensor, check_inner, dequantize_job, empty_copy, output_pointers,
                       quantize_store, ride_dequantize, scales_as_e4m3, u32)
from .rounding import outer_scales, round_to
from .runtime import (Launcher, autotune, cdiv, check_runnable, interpreting, prune_wide_tiles,
                      scalar, scalar_arg)
from .tiles import load_col_blocks, load_row_blocks


def quantize_configs():
    """Autotuning space of the grouped quantize kernels (token groups here, expert weights in
    ``expert_weights``): (BB, BC) = a tile of 16 BB x 16 BC elements. Untuned on GPUs yet
    (benchmarks/bench_moe.py); one small tile in the interpreter."""
    if interpreting():
        return [triton.Config({"BB": 2, "BC": 2}, num_warps=1)]
    return [triton.Config({"BB": bb, "BC": bc}, num_warps=nw)
            for bb, bc, nw in ((2, 8, 4), (2, 4, 4), (4, 8, 4), (4, 8, 8))]


def quantize_prune(*prefixes: str):
    """The autotuner's pruning of a grouped quantize kernel whose copies' 4/6 constexprs have
    these prefixes (``four_over_six.lead_tile``)."""
    return prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], lead_tile(*prefixes))


@triton.jit
def _store_group_outer_scales(amax_ptr, o_ptr, n, amax_scale, HAS_AMAX_SCALE: tl.constexpr,
                              FOUR_OVER_SIX_E4M3_MAX: tl.constexpr):
    """S_dec of the ``n`` amaxes at amax_ptr stored at o_ptr (``rounding.outer_scales``): the
    per-group outer scales, written by one program since a group may have no tile."""
    for j0 in range(0, n, GROUPS_PER_STEP):
        j = j0 + tl.arange(0, GROUPS_PER_STEP)
        _, s_dec, _ = outer_scales(tl.load(amax_ptr + j, mask=j < n, other=0.0), amax_scale,
                                   HAS_AMAX_SCALE, FOUR_OVER_SIX_E4M3_MAX)
        tl.store(o_ptr + j, s_dec, mask=j < n)


@autotune(configs=quantize_configs(),
          key=["M", "K", "ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_HAS_AMAX_SCALE", "ROW_INNER", "COL",
               "COL_RHT", "COL_SR", "COL_PER_TOKEN", "COL_HAS_AMAX_SCALE", "COL_INNER",
               *four_over_six_names("ROW_", "COL_"), "DEQUANTIZE", "deq_rows", "deq_row_bytes"],
          prune=quantize_prune("ROW_", "COL_"))
@triton.jit
def _quantize_grouped_kernel(x_ptr, M, K, stride_m, stride_k, offs_ptr, G, signs_ptr, seed_arg,
                             mul16, rq_ptr, rs_ptr, ro_ptr, ramax_ptr, r_amax_scale, roff_arg,
                             cq_ptr, cs_ptr, co_ptr, camax_ptr, c_amax_scale, coff_arg,
                             deq_q_ptr, deq_s_ptr, deq_out_ptr, deq_rows, deq_row_bytes,
                             deq_stride_q, deq_stride_s, deq_stride_o,
                             ROW: tl.constexpr, ROW_SR: tl.constexpr, ROW_PER_TOKEN: tl.constexpr,
                             ROW_HAS_AMAX_SCALE: tl.constexpr, ROW_INNER: tl.constexpr,
                             COL: tl.constexpr, COL_RHT: tl.constexpr, COL_SR: tl.constexpr,
                             COL_PER_TOKEN: tl.constexpr, COL_HAS_AMAX_SCALE: tl.constexpr,
                             COL_INNER: tl.constexpr, ROW_FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                             ROW_FOUR_OVER_SIX_MSE: tl.constexpr,
                             ROW_FOUR_OVER_SIX_FAST_MATH: tl.constexpr,
                             COL_FOUR_OVER_SIX_E4M3_MAX: tl.constexpr,
                             COL_FOUR_OVER_SIX_MSE: tl.constexpr,
                             COL_FOUR_OVER_SIX_FAST_MATH: tl.constexpr, SEED_PTR: tl.constexpr,
                             ROFF_PTR: tl.constexpr, COFF_PTR: tl.constexpr,
                             DEQUANTIZE: tl.constexpr, DEQ_BLOCK_2D: tl.constexpr,
                             DEQ_BR: tl.constexpr, DEQ_H: tl.constexpr, DEQ_EVEN_K: tl.constexpr,
                             DEQ_PTX: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """One (16 BB, 16 BC) tile of x a program: its rowwise copy from the (16 BB, BC, 16) row
    blocks, its columnwise copy from the (16 BC, BB, 16) column blocks (read again: L1/L2 hits),
    each block with the outer scale of its group (or token). The per-group outer scales are
    written by program (0, 0) (a group may have no tile), per-token ones by the programs holding
    the first column (rowwise) or the first row (columnwise) of a tile column. With DEQUANTIZE
    each program then takes its share of another operand's dequantize pass
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
    g = group_of(16 * b, offs_ptr, G)
    if ROW:
        g_m = tl.reshape(tl.broadcast_to(g[:, None], (BB, 16)), (16 * BB,))
        if ROW_PER_TOKEN:
            s_enc6, s_dec, amax = outer_scales(tl.load(ramax_ptr + m, mask=m < M, other=0.0),
                                               r_amax_scale, ROW_HAS_AMAX_SCALE,
                                               ROW_FOUR_OVER_SIX_E4M3_MAX)
            if pid_c == 0:
                tl.store(ro_ptr + m, s_dec, mask=(m < M) & (g_m < G))
        else:
            s_enc6, s_dec, amax = outer_scales(tl.load(ramax_ptr + g_m, mask=g_m < G, other=0.0),
                                               r_amax_scale, ROW_HAS_AMAX_SCALE,
                                               ROW_FOUR_OVER_SIX_E4M3_MAX)
            if first:
                _store_group_outer_scales(ramax_ptr, ro_ptr, G, r_amax_scale, ROW_HAS_AMAX_SCALE,
                                          ROW_FOUR_OVER_SIX_E4M3_MAX)
        rows = tl.where(g_m < G, m, M)  # rows past the last group: stores masked off
        quantize_store(y.to(tl.float32), rows[:, None], c[None, :], M, K, rq_ptr, rs_ptr,
                       s_enc6[:, None], s_dec[:, None], amax[:, None], seed,
                       scalar_arg(roff_arg, ROFF_PTR), mul16, ROW_SR, ROW_INNER,
                       ROW_FOUR_OVER_SIX_E4M3_MAX, ROW_FOUR_OVER_SIX_MSE,
                       ROW_FOUR_OVER_SIX_FAST_MATH)
    if COL:  # x^T (K, M): rows k, block columns b, group g of x_g^T (K, M_g)
        k = pid_c * (16 * BC) + tl.arange(0, 16 * BC)
        y = load_col_blocks(x_ptr, k, b, M, K, stride_m, stride_k)
        start = group_start(g, offs_ptr, G)
        n_g = (tl.load(offs_ptr + g, mask=g < G, other=0) - start) // 16  # blocks in the group
        if COL_PER_TOKEN:
            idx = g[None, :] * K + k[:, None]
            amax = tl.load(camax_ptr + idx, mask=(g < G)[None, :] & (k < K)[:, None], other=0.0)
            s_enc6, s_dec, amax = outer_scales(amax, c_amax_scale, COL_HAS_AMAX_SCALE,
                                               COL_FOUR_OVER_SIX_E4M3_MAX)  # (16 BC, BB)
            if pid_b == 0:
                for g0 in range(0, G, GROUPS_PER_STEP):
                    gg = g0 + tl.arange(0, GROUPS_PER_STEP)
                    o_idx = gg[:, None] * K + k[None, :]
                    o_mask = (gg < G)[:, None] & (k < K)[None, :]
                    _, o, _ = outer_scales(tl.load(camax_ptr + o_idx, mask=o_mask, other=0.0),
                                           c_amax_scale, COL_HAS_AMAX_SCALE,
                                           COL_FOUR_OVER_SIX_E4M3_MAX)
                    tl.store(co_ptr + o_idx, o, mask=o_mask)
        else:
            s_enc6, s_dec, amax = outer_scales(tl.load(camax_ptr + g, mask=g < G, other=0.0),
                                               c_amax_scale, COL_HAS_AMAX_SCALE,
                                               COL_FOUR_OVER_SIX_E4M3_MAX)
            s_enc6, s_dec, amax = s_enc6[None, :], s_dec[None, :], amax[None, :]
            if first:
                _store_group_outer_scales(camax_ptr, co_ptr, G, c_amax_scale, COL_HAS_AMAX_SCALE,
                                          COL_FOUR_OVER_SIX_E4M3_MAX)
        if COL_RHT:
            yf = round_to(rht16(y.to(tl.float32), tl.load(signs_ptr + tl.arange(0, 16))), y.dtype)
        else:
            yf = y.to(tl.float32)
        # Group g's counter of block (k, b) is col_offset + start/16 * K + k * n_g + (b - start/16)
        # (its dense copy's, module docstring); quantize_store adds the block's index in the
        # (K, M/16) grid of all groups, k * (M/16) + b, so the offset passed takes it back off
        # (uint32 arithmetic wraps as the Philox counter does).
        s16 = u32(start // 16)[None, :]
        off = (u32(scalar_arg(coff_arg, COFF_PTR)) + s16 * u32(K) - s16
               + u32(k[:, None]) * (u32(n_g) - u32(M // 16))[None, :])
        blocks = tl.where(g < G, b, M // 16)  # token blocks past the last group: masked off
        quantize_store(yf, k[:, None], blocks[None, :], K, M, cq_ptr, cs_ptr, s_enc6, s_dec, amax,
                       seed, off, mul16, COL_SR, COL_INNER, COL_FOUR_OVER_SIX_E4M3_MAX,
                       COL_FOUR_OVER_SIX_MSE, COL_FOUR_OVER_SIX_FAST_MATH)
    if DEQUANTIZE:
        ride_dequantize(deq_q_ptr, deq_s_ptr, deq_out_ptr, deq_rows, deq_row_bytes, deq_stride_q,
                        deq_stride_s, deq_stride_o, DEQ_BLOCK_2D, DEQ_BR, DEQ_H, DEQ_EVEN_K,
                        DEQ_PTX)


_QUANTIZE_GROUPED = Launcher(_quantize_grouped_kernel)


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
        amaxes: the (row, column) amaxes as ``grouped_amax.grouped_amax_pass`` returns them for
            these specs, to skip the amax pass (benchmarks time the two passes apart).
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
            *(output_pointers(r) if r else (dummy, dummy)), r.outer_scale if r else dummy,
            row_amax if r else dummy, float(row.amax_scale or 1.0) if r else 1.0, roff_a,
            *(output_pointers(c) if c else (dummy, dummy)), c.outer_scale if c else dummy,
            col_amax if c else dummy, float(col.amax_scale or 1.0) if c else 1.0, coff_a, *d_args,
            **d_consts, ROW=r is not None, ROW_SR=bool(row and row.sr),
            ROW_PER_TOKEN=bool(row and row.per_token),
            ROW_HAS_AMAX_SCALE=bool(row and row.amax_scale is not None),
            ROW_INNER=bool(row and inner[0]), COL=c is not None, COL_RHT=bool(col and col.rht),
            COL_SR=bool(col and col.sr), COL_PER_TOKEN=bool(col and col.per_token),
            COL_HAS_AMAX_SCALE=bool(col and col.amax_scale is not None),
            COL_INNER=bool(col and inner[1]),
            **four_over_six_constexprs(row and row.four_over_six, "ROW_"),
            **four_over_six_constexprs(col and col.four_over_six, "COL_"),
            SEED_PTR=seed_p, ROFF_PTR=roff_p, COFF_PTR=coff_p)
    rows = GroupedOperand(scales_as_e4m3(r), offs, False, row.per_token) if r else None
    cols = GroupedOperand(scales_as_e4m3(c), offs, True, col.per_token) if c else None
    return rows, cols

"""The grouped NVFP4 GEMM of mixture-of-experts layers (:func:`grouped_scaled_mm`).

Operands (``operand.GroupedOperand``; docs/moe.md): the tokens of all experts form one (T, K)
matrix split into G groups by ``offs`` (``groups``); expert weights are (G, N, K) tensors. fprop and
dgrad take ``A`` grouped by rows and ``B`` one (N, K) operand per expert; wgrad takes both operands
grouped along K, the tokens, and gives one (N, K') output per expert. One persistent launch on
16-bit inner values (read through TMA descriptors on sm90+) with fp32 accumulation and the outer
scales in an fp32 epilogue (``gemm.epilogue``), rounded once; the fprop/dgrad outputs hold zeros in
the rows past ``offs[-1]``. ``torch._grouped_mm`` cannot take over here: torch 2.13 refuses an fp32
output for bf16 inputs (``_resolve_grouped_mm_out_dtype``), and rounding the product to bf16
before the outer scales would round twice.
"""

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..operand import GroupedOperand, NVFP4Operand
from ..spec import Form
from .dequantize import dequantize_inner
from .gemm import OUT_DTYPES, epilogue, kernel_out, mma, tile_pid
from .groups import check_offsets
from .runtime import capability, cdiv, check_runnable, interpreting, num_sms


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
        acc = mma(a, b, acc, INTERP)
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
        acc = mma(a_desc.load([row_a, k0]), b_desc.load([row_b, k0]).T, acc, INTERP)
    if MASK_K:
        if full_end < k_end:
            keep = (full_end + tl.arange(0, BK) < k_end)[None, :]
            a = tl.where(keep, a_desc.load([row_a, full_end]), 0.0)
            b = tl.where(keep, b_desc.load([row_b, full_end]), 0.0)
            acc = mma(a, b.T, acc, INTERP)
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
            pid_m, pid_n = tile_pid(t - done, rows, N, BM, BN, GROUP_M)
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
            epilogue(acc, offs_m, offs_n, m_end, N, sa_ptr + g * sa_g, sb_ptr + g * sb_g, sa_ptr,
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
    out = kernel_out(t, n, out_dtype, dev)
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
    out = kernel_out(a.groups * m, n, out_dtype, dev).view(a.groups, m, n)
    sb_g, sb_n = _scale_strides(b)
    args = dict(a_ptr=a_in, b_ptr=b_in, offs_ptr=a.offs, sa_ptr=a.data.outer_scale,
                sb_ptr=b.data.outer_scale, out_ptr=out, G=a.groups, M=m, N=n, K=0,
                stride_am=a_in.stride(0), stride_ak=a_in.stride(1), stride_bg=0,
                stride_bn=b_in.stride(0), stride_bk=b_in.stride(1), stride_og=out.stride(0),
                stride_om=out.stride(1), sb_g=sb_g, sb_n=sb_n)
    return out, args

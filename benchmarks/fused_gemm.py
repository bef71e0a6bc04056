"""An experiment kept for the benchmarks: the NVFP4 GEMM with the dequantization fused into its main loop.

One kernel loads the packed codes and block scales of both operands, dequantizes them in registers
(``kernels.dequantize``'s helpers) and runs ``tl.dot`` (wgmma; A from registers, B through shared
memory), the fp32 epilogue fused. Each K step of 2*H elements is split into its even (low-nibble)
and odd (high-nibble) elements, two dots of depth H: the same permutation of K for A and B, so the
sum is unchanged up to fp32 order. On Hopper, Triton waits for each wgmma before the next
dequantization, so the dequantization does not overlap the tensor cores and the kernel runs at
about half of bf16 ``torch.mm`` (benchmarks/bench_gemm.py), which is why the library dequantizes
in a separate pass instead (``kernels.gemm``).
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nvfp4_recipe.kernels.dequantize import _dequant_codes, _load_codes, check_codes  # noqa: E402
from nvfp4_recipe.kernels.gemm import _epilogue_args, epilogue, kernel_out, mma, tile_pid  # noqa: E402
from nvfp4_recipe.kernels.runtime import interpreting, ptx_dequant  # noqa: E402
from nvfp4_recipe.spec import Block  # noqa: E402

FUSED_CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=3)
_INTERP_CONFIG = dict(BM=32, BN=32, BK=64, GROUP_M=2, num_warps=4, num_stages=1)


@triton.jit
def _load_dequant(q_ptr, s_ptr, rows, kb, KB, stride_q, stride_s, ROWS: tl.constexpr,
                  H: tl.constexpr, BLOCK_2D: tl.constexpr, EVEN_K: tl.constexpr,
                  PTX: tl.constexpr):
    """:func:`_dequant_codes` of :func:`_load_codes`: lo[:, j] is element 2 * (kb + j), hi[:, j]
    element 2 * (kb + j) + 1."""
    q, s = _load_codes(q_ptr, s_ptr, rows, kb, KB, stride_q, stride_s, H, BLOCK_2D, EVEN_K)
    return _dequant_codes(q, s, ROWS, H, PTX)


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
    pid_m, pid_n = tile_pid(tl.program_id(0), M, N, BM, BN, GROUP_M)
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
        acc = mma(a_lo.to(dot_dtype), tl.trans(b_lo.to(dot_dtype)), acc, INTERP)
        acc = mma(a_hi.to(dot_dtype), tl.trans(b_hi.to(dot_dtype)), acc, INTERP)
    epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
             stride_o, HAS_BIAS)


def fused_mm(a, b, bias=None, out_dtype=torch.bfloat16, cfg=None):
    """D = (s_a * s_b) * (A_inner @ B_inner^T) + bias for two NVFP4Operands with codes, in one kernel."""
    a, b = check_codes("A", a), check_codes("B", b)
    cfg = dict(_INTERP_CONFIG if interpreting() else (cfg or FUSED_CONFIG))
    m, n, kb = a.rows, b.rows, a.k // 2
    out = kernel_out(m, n, out_dtype, a.qdata.device)
    scales, strides, flags = _epilogue_args(a.outer_scale, b.outer_scale, bias)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    kernel = _fused_gemm_kernel[grid](
        a.qdata, a.scale, b.qdata, b.scale, *scales, out, m, n, kb,
        a.qdata.stride(0), a.scale.stride(0), b.qdata.stride(0), b.scale.stride(0), *strides,
        out.stride(0), A_2D=a.block is Block.D2, B_2D=b.block is Block.D2, INTERP=interpreting(),
        PTX=ptx_dequant(a.qdata.device), EVEN_K=kb % (cfg["BK"] // 2) == 0, **flags, **cfg)
    return out.to(out_dtype), kernel

"""Compile the grouped kernels for a CUDA target without a GPU (``python compile_grouped.py 90``).

The Triton interpreter runs kernels as numpy and checks nothing of what the compiler checks (types
of loop-carried values, globals that are not constexpr, pointer types); this script lowers every
grouped kernel (``kernels/grouped_gemm.py``, ``grouped_amax.py``, ``grouped_quantize.py``,
``expert_weights.py``) in the variants the backends launch to PTX and cubin for the
target's compute capability. Run in a process without TRITON_INTERPRET
(tests/test_kernels_grouped.py).
Prints one line per variant and exits 1 if any fails.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without the Triton interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nvfp4_recipe.kernels import (expert_weights, grouped_amax, grouped_gemm,  # noqa: E402
                                  grouped_quantize, quantize)
from nvfp4_recipe.kernels.amax import NONE, PER_INDEX, TENSOR  # noqa: E402
from nvfp4_recipe.kernels.four_over_six import four_over_six_names  # noqa: E402

I32 = "i32"


def const(*names):
    return {n: "constexpr" for n in names}


GEMM = dict(a_ptr="*fp16", b_ptr="*fp16", offs_ptr="*i32", sa_ptr="*fp32", sb_ptr="*fp32",
            out_ptr="*bf16", **{n: I32 for n in ("G", "M", "N", "K", "stride_am", "stride_ak",
                                                 "stride_bg", "stride_bn", "stride_bk", "stride_og",
                                                 "stride_om", "sa_g", "sa_m", "sb_g", "sb_n")},
            **const("ALONG_K", "TMA", "INTERP", "BM", "BN", "BK", "GROUP_M", "NUM_PROGRAMS"))
GEMM_TMA = dict(GEMM, a_ptr="tensordesc<fp16[128, 64]>", b_ptr="tensordesc<fp16[128, 64]>")
AMAX = dict(x_ptr="*bf16", M=I32, K=I32, stride_m=I32, stride_k=I32, offs_ptr="*i32", G=I32,
            signs_ptr="*fp32", out_ptr="*fp32", col_off=I32,
            **const("ROW", "COL", "COL_RHT", "GP", "BB", "BC", "P"))
FLAGS = ("ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_HAS_AMAX_SCALE", "ROW_INNER", "COL", "COL_RHT",
         "COL_SR", "COL_PER_TOKEN", "COL_HAS_AMAX_SCALE", "COL_INNER")
QUANT = dict(x_ptr="*bf16", M=I32, K=I32, stride_m=I32, stride_k=I32, offs_ptr="*i32", G=I32,
             signs_ptr="*fp32", seed_arg="*i64", mul16=I32, rq_ptr="*i64", rs_ptr="*u8",
             ro_ptr="*fp32", ramax_ptr="*fp32", r_amax_scale="fp32", roff_arg="i64",
             cq_ptr="*i64", cs_ptr="*u8", co_ptr="*fp32", camax_ptr="*fp32", c_amax_scale="fp32",
             coff_arg="i64", deq_q_ptr="*u8", deq_s_ptr="*u8", deq_out_ptr="*fp16",
             **{n: I32 for n in ("deq_rows", "deq_row_bytes", "deq_stride_q", "deq_stride_s",
                                 "deq_stride_o")},
             **const(*FLAGS, *four_over_six_names("ROW_", "COL_"), "SEED_PTR", "ROFF_PTR",
                     "COFF_PTR", "DEQUANTIZE", "DEQ_BLOCK_2D", "DEQ_BR", "DEQ_H", "DEQ_EVEN_K",
                     "DEQ_PTX", "BB", "BC"))
EXPERTS = dict(w_ptr="*fp32", N=I32, K=I32, stride_g=I32, stride_n=I32, stride_k=I32,
               amax_ptr="*fp32", amax_scale="fp32", seed_arg="i64", off_arg="i64", mul16=I32,
               q_ptr="*i64", s_ptr="*u8", qt_ptr="*i64", st_ptr="*u8", o_ptr="*fp32",
               **const("W", "WT", "SR", "HAS_AMAX_SCALE", "INNER", *four_over_six_names(""),
                       "SEED_PTR", "OFF_PTR", "BB", "BC"))


def four_over_six(e4m3_max, mse=False, fast_math=False):
    """A copy's 4/6 constexprs by name (``four_over_six.four_over_six_constexprs``)."""
    return dict(zip(four_over_six_names(""), (e4m3_max, mse, fast_math)))


# 4/6 settings: none, MSE with bound 256, MAE with fast math and bound 448
FOS_OFF, FOS_MSE_256, FOS_FAST_448 = four_over_six(0), four_over_six(256, mse=True), \
    four_over_six(448, fast_math=True)


def quant_flags(on, inner=(), deq=False, fos=FOS_OFF):
    """QUANT's signature and constexprs with the flags ``on`` set (inner copies as fp16 values),
    with a 2d operand's dequantize pass riding along (``deq``, the dgrad W^T of the dY pair) and
    the 4/6 constexprs ``fos`` (:func:`four_over_six`) on both copies."""
    sig = dict(QUANT)
    for side in inner:
        sig[side + "q_ptr"] = sig[side + "s_ptr"] = "*fp16"
    flags = {f: f in on for f in FLAGS}
    flags.update(ROW_INNER="r" in inner, COL_INNER="c" in inner)
    rider = dict(DEQUANTIZE=deq, DEQ_BLOCK_2D=deq, DEQ_BR=32 if deq else 1,
                 DEQ_H=128 if deq else 1, DEQ_EVEN_K=True, DEQ_PTX=deq)
    both = {prefix + name: v for prefix in ("ROW_", "COL_") for name, v in fos.items()}
    return sig, dict(flags, **both, SEED_PTR=True, ROFF_PTR=False, COFF_PTR=False, BB=2, BC=8,
                     **rider)


def variants(capability):
    tiles = dict(BM=128, BN=128, BK=64, GROUP_M=8, NUM_PROGRAMS=132, INTERP=False)
    for along in (False, True):
        name = "along K" if along else "rows"
        yield (f"gemm {name}", grouped_gemm._grouped_gemm_kernel, GEMM,
               dict(tiles, ALONG_K=along, TMA=False))
        if capability >= 90:
            yield f"gemm {name} TMA", grouped_gemm._grouped_gemm_kernel, GEMM_TMA, \
                dict(tiles, ALONG_K=along, TMA=True)
    for row, col, rht in ((TENSOR, TENSOR, True), (PER_INDEX, PER_INDEX, True),
                          (TENSOR, PER_INDEX, False), (NONE, TENSOR, False)):
        yield f"amax {row}/{col}/{rht}", grouped_amax._grouped_amax_kernel.fn, AMAX, \
            dict(ROW=row, COL=col, COL_RHT=rht, GP=8, BB=2, BC=16, P=4)
    inner = ("r", "c") if capability >= 89 else ()
    per_token = ("ROW", "ROW_PER_TOKEN", "COL", "COL_RHT", "COL_PER_TOKEN", "COL_HAS_AMAX_SCALE")
    for name, on, inn, fos in (("X pair", ("ROW", "COL", "COL_RHT"), inner[:1], FOS_OFF),
                               ("dY pair", ("ROW", "ROW_SR", "COL", "COL_RHT", "COL_SR"), inner,
                                FOS_OFF),
                               ("per-token pair", per_token, (), FOS_OFF),
                               ("rows only", ("ROW",), (), FOS_OFF),
                               ("dY pair 4/6", ("ROW", "ROW_SR", "COL", "COL_RHT", "COL_SR"), inner,
                                FOS_MSE_256),
                               ("per-token pair 4/6", per_token, (), FOS_FAST_448)):
        sig, consts = quant_flags(on, inn, deq=name == "dY pair" and capability >= 89, fos=fos)
        yield "quantize " + name, grouped_quantize._quantize_grouped_kernel.fn, sig, consts
    for sr, inner, fos, fos_name in ((False, False, FOS_OFF, "off"), (True, False, FOS_OFF, "off"),
                                     (False, True, FOS_OFF, "off"),
                                     (True, False, FOS_MSE_256, "MSE 256"),
                                     (False, True, FOS_FAST_448, "fast 448")):
        if inner and capability < 89:
            continue
        flags = dict(W=True, WT=True, SR=sr, HAS_AMAX_SCALE=False, INNER=inner, **fos,
                     SEED_PTR=False, OFF_PTR=False, BB=2, BC=8)
        sig = dict(EXPERTS, q_ptr="*fp16", s_ptr="*fp16") if inner else EXPERTS
        tag = f"sr={sr} inner={inner} 4/6 {fos_name}"
        yield f"experts 2d {tag}", expert_weights._experts_2d_kernel.fn, sig, flags
        yield (f"dense 2d {tag}", quantize._quantize_2d_kernel.fn,
               {k: v for k, v in sig.items() if k != "stride_g"}, flags)


def main(capability: int) -> int:
    target = GPUTarget("cuda", capability, 32)
    failed = 0
    for name, fn, sig, consts in variants(capability):
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options={"num_warps": 4, "num_stages": 3})
            print(f"ok   {name}")
        except Exception as e:  # report every failing variant, not only the first
            failed += 1
            cause = e.__cause__ if e.__cause__ is not None else e
            print(f"FAIL {name}: {type(cause).__name__}: {str(cause)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))

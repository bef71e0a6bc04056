"""Compile the grouped kernels for a CUDA target without a GPU (``python compile_grouped.py 90``).

The Triton interpreter runs kernels as numpy and checks nothing of what the compiler checks (types
of loop-carried values, globals that are not constexpr, pointer types); this script lowers every
kernel of ``kernels/grouped.py`` in the variants the backends launch to PTX and cubin for the
target's compute capability. Run in a process without TRITON_INTERPRET (tests/test_kernels_grouped.py).
Prints one line per variant and exits 1 if any fails.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without the Triton interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nvfp4_recipe.kernels import grouped as KG  # noqa: E402
from nvfp4_recipe.kernels import quantize as Q  # noqa: E402

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
FLAGS = ("ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_MULT", "ROW_INNER", "COL", "COL_RHT", "COL_SR",
         "COL_PER_TOKEN", "COL_MULT", "COL_INNER")
QUANT = dict(x_ptr="*bf16", M=I32, K=I32, stride_m=I32, stride_k=I32, offs_ptr="*i32", G=I32,
             signs_ptr="*fp32", seed_arg="*i64", mul16=I32, rq_ptr="*i64", rs_ptr="*u8",
             ro_ptr="*fp32", ramax_ptr="*fp32", r_mult="fp32", roff_arg="i64", cq_ptr="*i64",
             cs_ptr="*u8", co_ptr="*fp32", camax_ptr="*fp32", c_mult="fp32", coff_arg="i64",
             dq_ptr="*u8", ds_ptr="*u8", dout_ptr="*fp16",
             **{n: I32 for n in ("D_R", "D_KB", "d_stride_q", "d_stride_s", "d_stride_o")},
             **const(*FLAGS, "ROW_FOS", "COL_FOS", "SEED_PTR", "ROFF_PTR", "COFF_PTR", "DEQ",
                     "D_BLOCK_2D", "D_BR", "D_H", "D_EVEN_K", "D_PTX", "BB", "BC"))
EXPERTS = dict(w_ptr="*fp32", N=I32, K=I32, stride_g=I32, stride_n=I32, stride_k=I32,
               amax_ptr="*fp32", mult="fp32", seed_arg="i64", off_arg="i64", mul16=I32,
               q_ptr="*i64", s_ptr="*u8", qt_ptr="*i64", st_ptr="*u8", o_ptr="*fp32",
               **const("W", "WT", "SR", "MULT", "INNER", "FOS", "SEED_PTR", "OFF_PTR", "BB", "BC"))


def quant_flags(on, inner=(), deq=False, fos=0):
    """QUANT's signature and constexprs with the flags ``on`` set (inner copies as fp16 values),
    with a 2d operand's dequantize pass riding along (``deq``, the dgrad W^T of the dY pair) and
    4/6 code ``fos`` on both copies (``kernels.four_over_six.fos_code``)."""
    sig = dict(QUANT)
    for side in inner:
        sig[side + "q_ptr"] = sig[side + "s_ptr"] = "*fp16"
    flags = {f: f in on for f in FLAGS}
    flags.update(ROW_INNER="r" in inner, COL_INNER="c" in inner)
    rider = dict(DEQ=deq, D_BLOCK_2D=deq, D_BR=32 if deq else 1, D_H=128 if deq else 1,
                 D_EVEN_K=True, D_PTX=deq)
    return sig, dict(flags, ROW_FOS=fos, COL_FOS=fos, SEED_PTR=True, ROFF_PTR=False,
                     COFF_PTR=False, BB=2, BC=8, **rider)


def variants(capability):
    tiles = dict(BM=128, BN=128, BK=64, GROUP_M=8, NUM_PROGRAMS=132, INTERP=False)
    for along in (False, True):
        name = "along K" if along else "rows"
        yield f"gemm {name}", KG._grouped_gemm_kernel, GEMM, dict(tiles, ALONG_K=along, TMA=False)
        if capability >= 90:
            yield f"gemm {name} TMA", KG._grouped_gemm_kernel, GEMM_TMA, \
                dict(tiles, ALONG_K=along, TMA=True)
    for row, col, rht in ((1, 1, True), (2, 2, True), (1, 2, False), (0, 1, False)):
        yield f"amax {row}/{col}/{rht}", KG._grouped_amax_kernel.fn, AMAX, \
            dict(ROW=row, COL=col, COL_RHT=rht, GP=8, BB=2, BC=16, P=4)
    inner = ("r", "c") if capability >= 89 else ()
    # 4/6 codes: 0 off, 257 MSE bound 256, 450 MAE fast math bound 448
    for name, on, inn, fos in (("X pair", ("ROW", "COL", "COL_RHT"), inner[:1], 0),
                               ("dY pair", ("ROW", "ROW_SR", "COL", "COL_RHT", "COL_SR"), inner, 0),
                               ("per-token pair", ("ROW", "ROW_PER_TOKEN", "COL", "COL_RHT",
                                                   "COL_PER_TOKEN", "COL_MULT"), (), 0),
                               ("rows only", ("ROW",), (), 0),
                               ("dY pair 4/6", ("ROW", "ROW_SR", "COL", "COL_RHT", "COL_SR"), inner,
                                257),
                               ("per-token pair 4/6", ("ROW", "ROW_PER_TOKEN", "COL", "COL_RHT",
                                                       "COL_PER_TOKEN", "COL_MULT"), (), 450)):
        sig, consts = quant_flags(on, inn, deq=name == "dY pair" and capability >= 89, fos=fos)
        yield "quantize " + name, KG._quantize_grouped_kernel.fn, sig, consts
    for sr, inner, fos in ((False, False, 0), (True, False, 0), (False, True, 0), (True, False, 257),
                           (False, True, 450)):
        if inner and capability < 89:
            continue
        flags = dict(W=True, WT=True, SR=sr, MULT=False, INNER=inner, FOS=fos, SEED_PTR=False,
                     OFF_PTR=False, BB=2, BC=8)
        sig = dict(EXPERTS, q_ptr="*fp16", s_ptr="*fp16") if inner else EXPERTS
        yield f"experts 2d sr={sr} inner={inner} fos={fos}", KG._experts_2d_kernel.fn, sig, flags
        yield (f"dense 2d sr={sr} inner={inner} fos={fos}", Q._quantize_2d_kernel.fn,
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

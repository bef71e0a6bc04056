"""Static SASS instruction counts of the quantize kernels for sm90, without a GPU.

Compiles the quantize kernels (``kernels.quantize``: the 1d pair kernel, the rowwise-only loop
kernel, the 2d weight kernel) for ``GPUTarget("cuda", 90, 32)`` in the variants the layers launch,
with the divisibility hints a launch on 16-aligned shapes gets (so that loads vectorize as on the
GPU), disassembles each cubin with the ``cuobjdump`` Triton ships, and prints per variant:

- main path: the instructions a thread runs over one tile when no slow path is taken, per
  element and thread (:func:`opcodes`: a loop kernel's body counted once, for one tile), which
  matches Nsight Compute's dynamic count of such a tile;
- half-rate pipe: those of them on the integer/logic/compare/min-max pipe (:data:`HALF_RATE`,
  an estimate by opcode), which issues at half the fp32 pipe's rate on Hopper;
- all: every instruction of the kernel, slow paths included;
- registers per thread, and the most frequent opcodes of the main path.

This is how a kernel change is weighed before spending GPU time (docs/dev/performance-notes.md has
the counts beside the measured bandwidth). Run without TRITON_INTERPRET:

    python benchmarks/sass_count.py [--only SUBSTRING] [--dump DIR]
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Dict

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nvfp4_recipe.kernels import amax as A
from nvfp4_recipe.kernels import expert_weights, grouped_quantize
from nvfp4_recipe.kernels import quantize as Q
from nvfp4_recipe.kernels.four_over_six import four_over_six_constexprs
from nvfp4_recipe.spec import FourOverSix

MAE_256 = FourOverSix("mae", 256)  # the recipe's 4/6
FOS_OFF = four_over_six_constexprs(None)
DIV16 = {"M", "K", "N", "stride_m", "stride_n", "deq_rows", "deq_row_bytes", "deq_stride_q",
         "deq_stride_s", "deq_stride_o"}
WARPS = 4
PAIR_OFF = dict(ROW=False, ROW_SR=False, ROW_PER_TOKEN=False, ROW_HAS_AMAX_SCALE=False,
                ROW_INNER=False, COL_RHT=False, COL_SR=False, COL_PER_TOKEN=False,
                COL_HAS_AMAX_SCALE=False, COL_INNER=False,
                **four_over_six_constexprs(None, "ROW_"), **four_over_six_constexprs(None, "COL_"),
                SEED_PTR=False, ROFF_PTR=False, COFF_PTR=False, DEQUANTIZE=False,
                DEQ_BLOCK_2D=False, DEQ_BR=1, DEQ_H=1, DEQ_EVEN_K=True, DEQ_PTX=False, BB=2, BC=8)
ROWS_OFF = dict(SR=False, PER_TOKEN=False, HAS_AMAX_SCALE=False, INNER=False, RHT=False,
                **FOS_OFF, SEED_PTR=False, OFF_PTR=False, BB=1, BC=8, T=4)
W2D_OFF = dict(W=True, WT=True, SR=False, HAS_AMAX_SCALE=False, INNER=False, **FOS_OFF,
               SEED_PTR=False, OFF_PTR=False, BB=4, BC=8)
PAIR_4_6 = {**four_over_six_constexprs(MAE_256, "ROW_"),
            **four_over_six_constexprs(MAE_256, "COL_")}


@dataclass
class Variant:
    kernel: object  # the autotuned kernel; its first config's tile is BB, BC (T) below
    consts: Dict[str, object]
    inner: Dict[str, bool] = field(default_factory=dict)  # output pointer prefix -> fp16 values

    def elements(self) -> int:
        """Elements of x one program quantizes."""
        c = self.consts
        return 256 * c["BB"] * c["BC"]  # a loop kernel's main path holds one tile's body


def pair(kernel=Q._quantize_1d_kernel, **on) -> Variant:
    consts = {**PAIR_OFF, **on}
    return Variant(kernel, consts, {"r": consts["ROW_INNER"], "c": consts["COL_INNER"]})


ACT = dict(ROW=True, ROW_INNER=True, COL_RHT=True)  # fprop X inner + wgrad X^T RHT codes
GRAD = dict(ROW=True, ROW_SR=True, ROW_INNER=True, COL_RHT=True, COL_SR=True, COL_INNER=True)
VARIANTS = {
    "activation pair (X inner + X^T RHT codes)": pair(**ACT),
    "gradient pair (dY SR inner + dY^T RHT SR inner)": pair(**GRAD),
    "4/6 activation pair": pair(**ACT, **PAIR_4_6),
    "4/6 gradient pair": pair(**GRAD, **PAIR_4_6),
    "columnwise RN codes only": pair(),
    "rowwise RN codes (loop kernel)": Variant(Q._quantize_rows_kernel, dict(ROWS_OFF)),
    "rowwise per-token SR inner (loop kernel)": Variant(
        Q._quantize_rows_kernel, {**ROWS_OFF, "SR": True, "PER_TOKEN": True, "INNER": True},
        {"": True}),
    "2d weight W + W^T": Variant(Q._quantize_2d_kernel, dict(W2D_OFF)),
    "2d weight W inner + W^T": Variant(Q._quantize_2d_kernel, {**W2D_OFF, "INNER": True}, {"": True}),
    "4/6 2d weight W + W^T": Variant(Q._quantize_2d_kernel,
                                     {**W2D_OFF, **four_over_six_constexprs(MAE_256)}),
    "grouped activation pair (MoE tokens)": pair(grouped_quantize._quantize_grouped_kernel,
                                                 COL=True, **ACT),
    "grouped gradient pair (MoE tokens)": pair(grouped_quantize._quantize_grouped_kernel, COL=True,
                                               **GRAD),
    "experts 2d weight W inner + W^T": Variant(expert_weights._experts_2d_kernel,
                                               {**W2D_OFF, "INNER": True}, {"": True}),
    "amax + RHT amax of X^T (one pass; one tile)": Variant(
        A._amax_kernel, dict(ROW=A.TENSOR, COL=A.TENSOR, COL_RHT=True, ROW_RHT=False, BB=2, BC=16,
                             P=4)),
}


def _type(name: str, inner: Dict[str, bool]) -> str:
    """The argument type of a non-constexpr parameter for a bf16 input (fp16 pointers for
    inner-value outputs, int64 views of packed codes, uint8 scales)."""
    fixed = {"x_ptr": "*bf16", "w_ptr": "*bf16", "signs_ptr": "*fp32", "deq_q_ptr": "*u8",
             "deq_s_ptr": "*u8", "deq_out_ptr": "*fp16", "amax_scale": "fp32",
             "r_amax_scale": "fp32", "c_amax_scale": "fp32", "offs_ptr": "*i32"}
    if name in fixed:
        return fixed[name]
    if name.endswith("_arg"):
        return "i64"
    for prefix, values in inner.items():
        if name in (f"{prefix}q_ptr", f"{prefix}s_ptr"):
            return "*fp16" if values else ("*i64" if name.endswith("q_ptr") else "*u8")
    if name in ("q_ptr", "qt_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*u8" if name in ("s_ptr", "st_ptr") else "*fp32"
    return "i32"


def compile_variant(v: Variant):
    fn = v.kernel.fn
    params = [p for p in fn.params if not p.is_constexpr]
    sig = {p.name: _type(p.name, v.inner) for p in params}
    stride_k = "stride_k"
    sig[stride_k] = "constexpr"  # Triton specializes a stride of 1
    consts = {**v.consts, stride_k: 1}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
    names = [p.name for p in fn.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or n in DIV16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": WARPS, "num_stages": 3})


def cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump FLAG`` of the kernel's cubin (``-sass``: the SASS; ``-res-usage``: registers)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


# Opcodes that issue on the integer/logic/compare/min-max pipe, half the rate of the fp32 pipe on
# Hopper: a kernel bound by issue takes about max(all, 2 x these) cycles a warp instruction.
HALF_RATE = {"LOP3", "SHF", "IADD3", "ISETP", "FSETP", "SEL", "FSEL", "FMNMX", "IMNMX", "VIMNMX",
             "PRMT", "LEA", "BMSK", "PLOP3"}
_INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def opcodes(text: str):
    """(main path, all): the opcodes (without modifiers, NOPs left out) of the main path, and of
    the whole kernel. The main path walks from the entry, through every predicated branch (a
    division's slow-path guard, a loop's back edge, the uniform branch to an fp64 fallback:
    each laid out as the branch not taken), along every unpredicated ``BRA``, up to the first
    unpredicated ``EXIT``."""
    code = [(int(a, 16), pred, op.split(".")[0], rest) for a, pred, op, rest in _INSTR.findall(text)]
    code = [c for c in code if c[2] != "NOP"]
    at = {addr: i for i, (addr, *_) in enumerate(code)}
    main, i = [], 0
    while i < len(code) and len(main) <= len(code):
        _, pred, op, rest = code[i]
        main.append(op)
        if op == "EXIT" and not pred:
            break
        target = re.search(r"0x([0-9a-f]+)\s*$", rest)
        i = at.get(int(target[1], 16), i + 1) if op == "BRA" and not pred and target else i + 1
    return main, [c[2] for c in code]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="count the variants whose name contains this")
    p.add_argument("--dump", help="write each variant's SASS into this folder")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    print("| kernel variant | main path / element | half-rate pipe | all / element | registers "
          "| top opcodes (main path) |\n| --- | --- | --- | --- | --- | --- |")
    for name, v in VARIANTS.items():
        if args.only and args.only not in name:
            continue
        k = compile_variant(v)
        text = cuobjdump(k, "-sass")
        regs = re.search(r"REG:(\d+)", cuobjdump(k, "-res-usage"))[1]
        main_ops, all_ops = opcodes(text)
        per_thread = v.elements() / (32 * WARPS)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(main_ops).most_common(8))
        half = sum(op in HALF_RATE for op in main_ops)
        print(f"| {name} | {len(main_ops) / per_thread:.1f} | {half / per_thread:.1f} | "
              f"{len(all_ops) / per_thread:.1f} | {regs} | {top} |", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()

"""Static SASS instruction counts of the quantize pair kernel for sm90, without a GPU.

Compiles ``kernels.quantize._quantize_1d_kernel`` for ``GPUTarget("cuda", 90, 32)`` in the
variants NVFP4Linear launches, with the divisibility hints a launch on 16-aligned shapes gets
(so that loads vectorize as on the GPU), disassembles the cubin with the ``cuobjdump`` Triton
ships, and prints the instructions per element and thread (the program's straight-line code over
one (16 BB, 16 BC) tile, slow paths included) and the most frequent opcodes. Against the issue
budget of docs/performance.md ("The quantize pairs"), this is how a kernel change can be weighed
before spending GPU time. Run without TRITON_INTERPRET:

    python benchmarks/sass_count.py [--dump DIR]
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nvfp4_recipe.kernels import quantize as Q

FLAGS = ("ROW", "ROW_SR", "ROW_PER_TOKEN", "ROW_MULT", "ROW_INNER", "COL_RHT", "COL_SR",
         "COL_PER_TOKEN", "COL_MULT", "COL_INNER")
VARIANTS = {  # name: the flags set (NVFP4Linear's fprop X pass and backward dY pass)
    "activation pair (training: X inner + X^T RHT codes)": ("ROW", "ROW_INNER", "COL_RHT"),
    "gradient pair (training: dY inner SR + dY^T RHT SR inner)":
        ("ROW", "ROW_SR", "ROW_INNER", "COL_RHT", "COL_SR", "COL_INNER"),
    "columnwise RN codes only": (),
}
DIV16 = {"M", "K", "stride_m", "D_R", "D_KB", "d_stride_q", "d_stride_s", "d_stride_o"}
BB, BC, WARPS = 2, 8, 4  # the first autotune config


def signature(on) -> dict:
    """Argument types of the kernel for a bf16 input: fp16 pointers for inner-value outputs."""
    types = {"x_ptr": "*bf16", "signs_ptr": "*fp32", "seed_arg": "i64", "roff_arg": "i64",
             "coff_arg": "i64", "r_mult": "fp32", "c_mult": "fp32", "dq_ptr": "*u8",
             "ds_ptr": "*u8", "dout_ptr": "*fp16"}
    for side, inner in (("r", "ROW_INNER"), ("c", "COL_INNER")):
        types[f"{side}q_ptr"] = "*fp16" if inner in on else "*i64"
        types[f"{side}s_ptr"] = "*fp16" if inner in on else "*u8"
        types[f"{side}o_ptr"] = types[f"{side}amax_ptr"] = "*fp32"
    return {p.name: types.get(p.name, "i32") for p in Q._quantize_1d_kernel.fn.params
            if not p.is_constexpr}


def compile_variant(on):
    sig = signature(on)
    sig["stride_k"] = "constexpr"  # Triton specializes a stride of 1
    consts = {f: f in on for f in FLAGS}
    consts.update(stride_k=1, ROW_FOS=0, COL_FOS=0, SEED_PTR=False, ROFF_PTR=False, COFF_PTR=False,
                  DEQ=False, D_BLOCK_2D=False, D_BR=1, D_H=1, D_EVEN_K=True, D_PTX=False, BB=BB,
                  BC=BC)
    names = [p.name for p in Q._quantize_1d_kernel.fn.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or n in DIV16}
    src = ASTSource(fn=Q._quantize_1d_kernel.fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": WARPS, "num_stages": 3})


def sass(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def opcodes(text: str):
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    return [op.split(".")[0] for op in ops if op != "NOP"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump", help="write each variant's SASS into this folder")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    per_thread = 16 * BB * 16 * BC // (32 * WARPS)  # elements of the tile per thread
    for name, on in VARIANTS.items():
        text = sass(compile_variant(on))
        ops = opcodes(text)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(12))
        print(f"{name}: {len(ops)} SASS, {len(ops) / per_thread:.1f} an element and thread\n  {top}")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()

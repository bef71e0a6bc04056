"""Benchmark of the NVFP4 quantization and amax kernels (``nvfp4_recipe/kernels``) on a GPU.

For tokens M = 16384 and K in {4096, 14336}, bf16 input: the median time of each kernel, its
achieved bandwidth over the bytes it must move (input read once, codes and scales written once) and
that bandwidth as a fraction of a device-to-device copy measured in the same run (2 GiB, the
copy's full rate; and a copy moving the same bytes as the kernel, which shows how much of the gap
on smaller tensors is the ramp-up every kernel pays, L2 write-backs and launch included); beside them
torchao 0.18's ``torch.compile``d ``NVFP4Tensor.to_nvfp4`` (rowwise, per-tensor scale) as the peer.
Training runs an amax pass then a quantize pass; both are timed apart and together. The rows marked
"(training)" are the variants NVFP4Linear runs on the Triton backend: the copies a GEMM uses at once
are written as fp16 inner values (2 bytes an element) instead of codes and scales. The "public API"
rows time ``NVFP4Tensor.from_hp`` as a user calls it (checks, amax pass, quantize pass, the tensor),
their bytes those of one read and one rowwise copy.

    python benchmarks/bench_quantize.py [--json out.json] [--warm-procs 8] [--shapes 32768x512 ...]

``--shapes`` times other (M, K) shapes, e.g. the GPU preset model's operands (32768 tokens x 512,
1536 and 2048 features), where the pairs run narrower tiles than at the default shapes.

``--warm-procs`` compiles the kernel variants in parallel processes first (Triton's on-disk cache
then serves the timed process), which shortens a cold run on a many-core machine.
"""

import argparse
import dataclasses
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_gbps, environment, gbps, markdown_table, median_ms, write_json  # noqa: E402
from nvfp4_recipe import NVFP4Recipe, NVFP4Tensor  # noqa: E402
from nvfp4_recipe import reference as R  # noqa: E402
from nvfp4_recipe.kernels import amax as A  # noqa: E402
from nvfp4_recipe.kernels import quantize as Q  # noqa: E402
from nvfp4_recipe.kernels.quantize import amax_pass, quantize_1d, quantize_2d  # noqa: E402
from nvfp4_recipe.spec import FourOverSix, QuantSpec  # noqa: E402

SHAPES = [(16384, 4096), (16384, 14336)]
X_ROW, X_COL = QuantSpec(), QuantSpec(rht=True)  # fprop X, wgrad X^T (recipe defaults)
DY_ROW, DY_COL = QuantSpec(rounding="sr"), QuantSpec(rounding="sr", rht=True)  # dgrad dY, wgrad dY^T
# 4/6 (docs/numerics.md item 11): the same copies choosing each block's scale by its MAE in x's
# domain (fp64 divisions) or, with fast math, on the scaled values
FOS, FOS_FAST = FourOverSix("mae", 256), FourOverSix("mae", 256, fast_math=True)


def cases(x: torch.Tensor, signs: torch.Tensor):
    """(name, kind, fn, bytes moved) for each timed call on x (M, K)."""
    n = x.numel()
    copy_out = n // 2 + n // 16  # codes + E4M3 scales of one 1D copy
    plain, _ = amax_pass(x, X_ROW, None)
    both = amax_pass(x, X_ROW, X_COL, signs)
    sr = dict(seed=7, row_offset=0, col_offset=2**31)
    return [
        ("amax (global)", "amax", lambda: A.amax(x, A.TENSOR, A.NONE), 2 * n),
        ("amax + RHT amax of X^T (one pass)", "amax", lambda: amax_pass(x, X_ROW, X_COL, signs), 2 * n),
        ("quantize X rowwise RN", "quantize", lambda: quantize_1d(x, X_ROW, amaxes=(plain, None)),
         2 * n + copy_out),
        ("quantize X rowwise RN + X^T RHT RN", "quantize",
         lambda: quantize_1d(x, X_ROW, X_COL, signs=signs, amaxes=both), 2 * n + 2 * copy_out),
        ("quantize dY rowwise SR + dY^T RHT SR", "quantize",
         lambda: quantize_1d(x, DY_ROW, DY_COL, signs=signs, amaxes=both, **sr), 2 * n + 2 * copy_out),
        ("quantize X inner fp16 + X^T RHT RN (training)", "quantize",
         lambda: quantize_1d(x, X_ROW, X_COL, inner=(True, False), signs=signs, amaxes=both),
         2 * n + 2 * n + copy_out),
        ("quantize dY inner fp16 + dY^T RHT SR inner (training)", "quantize",
         lambda: quantize_1d(x, DY_ROW, DY_COL, inner=(True, True), signs=signs, amaxes=both, **sr),
         2 * n + 4 * n),
        ("quantize W 2D (W and W^T)", "quantize", lambda: quantize_2d(x, amax=plain),
         2 * n + 2 * (n // 2 + n // 256)),
        ("total X fprop: amax + rowwise RN", "total", lambda: quantize_1d(x, X_ROW), 4 * n + copy_out),
        ("total X pair: amax + quantize", "total", lambda: quantize_1d(x, X_ROW, X_COL, signs=signs),
         4 * n + 2 * copy_out),
        ("total dY pair: amax + quantize", "total",
         lambda: quantize_1d(x, DY_ROW, DY_COL, signs=signs, **sr), 4 * n + 2 * copy_out),
        ("total X pair, amax estimation", "total",
         lambda: quantize_1d(x, X_ROW, QuantSpec(rht=True, amax_scale=2.0), signs=signs),
         4 * n + 2 * copy_out),
        ("total W 2D: amax + quantize", "total", lambda: quantize_2d(x), 4 * n + 2 * (n // 2 + n // 256)),
        *four_over_six_cases(x, signs, plain, both, copy_out),
        ("NVFP4Tensor.from_hp RN (public API)", "api", lambda: NVFP4Tensor.from_hp(x), 2 * n + copy_out),
        ("NVFP4Tensor.from_hp SR + RHT (public API)", "api",
         lambda: NVFP4Tensor.from_hp(x, rounding="sr", rht=True), 2 * n + copy_out),
    ]


def four_over_six_cases(x, signs, plain, both, copy_out):
    """The 4/6 rows: the X pair, the dY pair (SR) and W 2D, each with 4/6 on every copy, in both
    error paths; compare with the rows of the same copies without 4/6."""
    return [row for tag, fos in (("4/6 MAE", FOS), ("4/6 MAE fast math", FOS_FAST))
            for row in _four_over_six_rows(x, signs, plain, both, copy_out, tag, fos)]


def _four_over_six_rows(x, signs, plain, both, copy_out, tag, fos):
    n = x.numel()
    x_row, x_col, dy_row, dy_col, w = (dataclasses.replace(sp, four_over_six=fos) for sp in
                                       (X_ROW, X_COL, DY_ROW, DY_COL, QuantSpec("2d")))
    sr = dict(seed=7, row_offset=0, col_offset=2**31)
    return [
        (f"quantize X rowwise RN + X^T RHT RN, {tag}", "four_over_six",
         lambda: quantize_1d(x, x_row, x_col, signs=signs, amaxes=both), 2 * n + 2 * copy_out),
        (f"quantize dY rowwise SR + dY^T RHT SR, {tag}", "four_over_six",
         lambda: quantize_1d(x, dy_row, dy_col, signs=signs, amaxes=both, **sr), 2 * n + 2 * copy_out),
        (f"quantize W 2D (W and W^T), {tag}", "four_over_six",
         lambda: quantize_2d(x, w, amax=plain), 2 * n + 2 * (n // 2 + n // 256)),
    ]


def torchao_case(x: torch.Tensor):
    """torchao 0.18's compiled NVFP4Tensor.to_nvfp4 with a per-tensor scale (rowwise only)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    scale = (x.abs().amax().float() / 2688.0)
    fn = torch.compile(lambda t, s: NVFP4Tensor.to_nvfp4(t, per_tensor_scale=s))
    n = x.numel()
    return ("torchao 0.18 to_nvfp4, compiled (rowwise RN)", "peer", lambda: fn(x, scale), 2 * n + n // 2 + n // 16)


def check(x: torch.Tensor, signs: torch.Tensor) -> None:
    """The timed calls give the reference's bits (a slice of the input, to stay quick)."""
    xs = x[:2048]
    for row, col, kw in ((X_ROW, X_COL, {}), (DY_ROW, DY_COL, dict(seed=7, row_offset=0, col_offset=2**31))):
        r, c = quantize_1d(xs, row, col, signs=signs, **kw)
        rr = R.quantize(xs, row, seed=kw.get("seed", 0), offset=kw.get("row_offset", 0), rht_signs=signs)
        rc = R.quantize(xs.t(), col, seed=kw.get("seed", 0), offset=kw.get("col_offset", 0),
                        rht_signs=signs)
        for out, ref in ((r, rr), (c, rc)):
            assert torch.equal(out.qdata, ref.qdata) and torch.equal(out.outer_scale, ref.outer_scale)
            assert torch.equal(out.scale.view(torch.uint8), ref.scale.view(torch.uint8))


def shape(text: str):
    """An ``MxK`` argument as (M, K), both multiples of 16."""
    try:
        m, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MxK, e.g. 32768x512") from None
    if m <= 0 or k <= 0 or m % 16 or k % 16:
        raise argparse.ArgumentTypeError(f"{text!r}: M and K must be positive multiples of 16")
    return m, k


def warm(procs: int) -> None:
    """Compile every kernel variant of the benchmark in ``procs`` parallel processes."""
    jobs = [subprocess.Popen([sys.executable, __file__, "--warm-only", str(i), str(procs)])
            for i in range(procs)]
    for j in jobs:
        j.wait()


def warm_only(index: int, procs: int) -> None:
    """Compile (and autotune on a small input) the cases numbered index mod procs; the last
    process also compiles torchao's peer at the benchmark shapes (torch.compile specializes)."""
    signs = NVFP4Recipe().signs().cuda()
    cs = cases(torch.randn(256, SHAPES[0][1], device="cuda", dtype=torch.bfloat16), signs)
    for i, (_, _, fn, _) in enumerate(cs):
        if i % procs == index:
            fn()
    if index == procs - 1:
        for m, k in SHAPES:
            try:
                torchao_case(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))[2]()
            except Exception as e:
                print(f"torchao: {type(e).__name__}: {e}")
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--warm-procs", type=int, default=0, help="precompile in N processes first")
    parser.add_argument("--warm-only", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--shapes", nargs="+", type=shape, default=SHAPES, metavar="MxK",
                        help="the (M, K) shapes to time (default: 16384x4096 16384x14336)")
    args = parser.parse_args()
    if args.warm_only:
        return warm_only(*args.warm_only)
    if args.warm_procs:
        warm(args.warm_procs)

    copy = copy_gbps()
    rows, same_size = [], {}
    for m, k in args.shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        signs = NVFP4Recipe().signs().cuda()
        check(x, signs)
        cs = cases(x, signs)
        if not args.no_torchao:
            cs.append(torchao_case(x))
        for name, kind, fn, nbytes in cs:
            try:
                fn()  # compile / autotune outside the timing
                ms = median_ms(fn)
            except Exception as e:  # a failing peer must not hide the other rows
                print(f"{name}: {type(e).__name__}: {e}")
                continue
            bw = gbps(nbytes, ms)
            if nbytes not in same_size:  # a copy moving the same bytes (small ones pay ramp-up)
                same_size[nbytes] = copy_gbps(nbytes // 2)
            kern = (Q._quantize_2d_kernel if "2D" in name else Q._quantize_1d_kernel
                    if "pair" in name or "^T" in name else Q._quantize_rows_kernel)
            cfg = getattr(kern, "best_config", None) if kind in ("quantize", "total", "four_over_six") else None
            rows.append({"shape": f"{m}x{k}", "kernel": name, "kind": kind, "us": ms * 1e3,
                         "GB/s": bw, "% of copy": 100 * bw / copy,
                         "% of same-size copy": 100 * bw / same_size[nbytes], "bytes": nbytes,
                         "config": str(cfg) if cfg is not None else ""})
        del x
        torch.cuda.empty_cache()

    payload = {"environment": environment(), "copy_GBps": copy, "rows": rows}
    if args.json:
        write_json(args.json, payload)
    print(f"\ndevice-to-device copy: {copy:.0f} GB/s (bytes read + written)")
    print(markdown_table(rows, ["shape", "kernel", "us", "GB/s", "% of copy", "% of same-size copy",
                                "config"]))


if __name__ == "__main__":
    main()

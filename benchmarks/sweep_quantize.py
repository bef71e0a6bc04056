"""Every autotune config of each NVFP4 quantize kernel, timed alone on the benchmark shapes.

For M = 16384, K in {4096, 14336} (and with ``--small`` the `train --preset gpu` shapes M = 32768,
K in {512, 2048}), bf16: the activation pair, the gradient pair, the rowwise RN copy, the 2D weight
kernel and the amax kernel (global; with the RHT amax; per-token, without and with the RHT amax),
each run with one config at a time (the autotuner's list is swapped in and out, the launcher's
cached binaries cleared); every config's output is checked
bit-identical to the first config's. Prints % of a device-to-device copy measured in the same run
and writes JSON. This is how the first config of each list in ``kernels/quantize.py`` and
``kernels/amax.py`` was chosen (docs/performance.md).

    python benchmarks/sweep_quantize.py [--json sweep.json]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_gbps, median_ms, write_json  # noqa: E402
from nvfp4_recipe import NVFP4Recipe  # noqa: E402
from nvfp4_recipe.kernels import amax as A  # noqa: E402
from nvfp4_recipe.kernels import quantize as Q  # noqa: E402
from nvfp4_recipe.kernels.quantize import amax_pass, quantize_1d, quantize_2d  # noqa: E402
from nvfp4_recipe.spec import QuantSpec  # noqa: E402

SHAPES = [(16384, 4096), (16384, 14336)]
SMALL_SHAPES = [(32768, 512), (32768, 2048)]


def cases(x: torch.Tensor, signs: torch.Tensor):
    """name -> (Launcher of the autotuned kernel, call, bytes moved), amaxes precomputed."""
    n = x.numel()
    one = n // 2 + n // 16
    plain, _ = amax_pass(x, QuantSpec(), None)
    both = amax_pass(x, QuantSpec(), QuantSpec(rht=True), signs)
    sr = dict(seed=7, col_offset=2**31)
    return {
        "act pair": (Q._PAIR, lambda: quantize_1d(
            x, QuantSpec(), QuantSpec(rht=True), signs=signs, amaxes=both), 2 * n + 2 * one),
        "grad pair": (Q._PAIR, lambda: quantize_1d(
            x, QuantSpec(rounding="sr"), QuantSpec(rounding="sr", rht=True), signs=signs, amaxes=both, **sr),
            2 * n + 2 * one),
        "rowwise RN": (Q._ROWS, lambda: quantize_1d(
            x, QuantSpec(), amaxes=(plain, None)), 2 * n + one),
        "W 2D": (Q._2D, lambda: quantize_2d(x, amax=plain),
                 2 * n + 2 * (n // 2 + n // 256)),
        "amax": (A._AMAX, lambda: A.amax(x), 2 * n),
        "amax+RHT amax": (A._AMAX, lambda: A.amax(x, A.TENSOR, A.TENSOR, True, signs), 2 * n),
        "per-token amax": (A._AMAX, lambda: A.amax(x, A.PER_INDEX, A.PER_INDEX), 2 * n),
        "per-token amax+RHT amax": (A._AMAX, lambda: A.amax(x, A.PER_INDEX, A.PER_INDEX, True, signs), 2 * n),
    }


def outputs(out):
    """The tensors of a quantize or amax call's result (tuples of NVFP4Operands, tensors or None),
    as raw bits."""
    flat = [t for q in out if q is not None
            for t in ((q,) if isinstance(q, torch.Tensor) else q) if isinstance(t, torch.Tensor)]
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in flat]


def sweep(launcher, fn, nbytes: int, copy: float):
    """Each config of the launcher's autotuned kernel alone: the autotuner's list and cache and
    the launcher's cached binaries are reset around every config."""
    kernel = launcher.kernel
    configs = list(kernel.configs)
    first = None
    try:
        for config in configs:
            kernel.configs = [config]
            kernel.cache.clear()
            launcher.clear()
            got = outputs(fn())
            first = first or got
            same = all(torch.equal(a, b) for a, b in zip(got, first))
            ms = median_ms(fn)
            yield {"config": str(config), "us": ms * 1e3, "% of copy": 100 * nbytes / ms / 1e6 / copy,
                   "bit-identical to the first": same}
    finally:
        kernel.configs = configs
        kernel.cache.clear()
        launcher.clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="sweep_quantize.json")
    parser.add_argument("--small", action="store_true", help="also the train --preset gpu shapes")
    parser.add_argument("--cases", nargs="*", help="only these cases (names as printed)")
    args = parser.parse_args()
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s")
    rows = []
    signs = NVFP4Recipe().signs().cuda()
    for m, k in SHAPES + (SMALL_SHAPES if args.small else []):
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for name, (launcher, fn, nbytes) in cases(x, signs).items():
            if args.cases and name not in args.cases:
                continue
            for row in sweep(launcher, fn, nbytes, copy):
                row = {"shape": f"{m}x{k}", "case": name, **row}
                rows.append(row)
                print(f"{row['shape']} {name:14s} {row['% of copy']:5.1f}% {row['us']:7.1f} us "
                      f"same={row['bit-identical to the first']} {row['config']}", flush=True)
    write_json(args.json, {"copy_GBps": copy, "rows": rows})


if __name__ == "__main__":
    main()

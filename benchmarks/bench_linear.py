"""NVFP4Linear forward+backward against bf16 nn.Linear on one GPU, with a time breakdown and memory.

For each (tokens, in, out) shape and recipe: the fwd+bwd time of NVFP4Linear over the bf16 nn.Linear
of the same run, the time of each piece (weight quantize, X quantize, dY quantize, fprop, dgrad,
wgrad GEMMs) timed alone, the peak memory of a step and the bytes saved for backward (counted with
saved-tensor hooks), split into activations and weight copies. Prints a table and writes JSON.
``--host`` instead measures the host (Python) time of one fwd+bwd call of a tiny layer, where the
GPU work is negligible: what bounds small layers in eager mode. ``--eval`` instead times forwards
under ``torch.no_grad()`` (evaluation; M = 16 is a decoding step of ``generate()``) of NVFP4Linear
with and without ``nvfp4_recipe.cached_weights()`` against bf16 nn.Linear.

    python benchmarks/bench_linear.py [--json out.json] [--shapes 16384x4096x4096 ...] [--host | --eval]
"""

import argparse
import statistics
import time

import torch
from torch import nn

from common import median_ms, write_json
from nvfp4_recipe import NVFP4Linear, NVFP4Recipe, cached_weights
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.recipe import SR_OFFSETS
from nvfp4_recipe.spec import GemmRole

RECIPES = {
    "default": NVFP4Recipe(),
    "per_token": NVFP4Recipe(scaling="per_token"),
    "amax_est": NVFP4Recipe(amax_estimation=(2.0, 1.0)),
}


def bench(fn) -> float:
    """Median milliseconds of ``fn`` over 300 ms of runs."""
    return median_ms(fn, warmup=50, rep=300)


def fwd_bwd(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """fwd + bwd under bf16 autocast, as training runs a layer with fp32 master weights on bf16
    activations (the bf16 nn.Linear's dtypes match already)."""
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            y = layer(x)
        y.backward(dy)
    return step


def saved_split(layer: nn.Module, x: torch.Tensor) -> dict:
    """Bytes saved for backward, split into activations (the part that grows with the tokens:
    twice the difference between the full batch and its first half) and the rest (copies of the
    weight, such as NVFP4Linear's quantized W^T for dgrad)."""
    full, half = saved_bytes(layer, x), saved_bytes(layer, x[: x.shape[0] // 2])
    activations = 2 * (full - half)
    return {"saved_bytes": full, "saved_activation_bytes": activations,
            "saved_weight_copy_bytes": full - activations}


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward (parameters and buffers excluded)."""
    params = {p.data_ptr() for p in layer.parameters()} | {b.data_ptr() for b in layer.buffers()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return total


def peak_memory(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def breakdown(layer: NVFP4Linear, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Milliseconds of each piece of an NVFP4Linear step, timed alone: the backend primitives
    ``gemms.fprop`` and ``gemms.grads`` call (on the Triton backend the transient operands
    are fp16 inner values, so the fprop and dgrad GEMMs include the dequantize pass of W or W^T;
    the dY pass also dequantizes X^T, wgrad's other operand)."""
    r, be = layer.recipe, get_backend(layer.recipe.backend, x.device)
    w, signs, seed = layer.weight, layer.rht_signs, layer.sr_seed
    spec = {role: r.spec(role) for role in GemmRole}
    wq, wtq = be.prepare_weight(w, spec[GemmRole.W_FPROP], need_t=True)
    x_ops = lambda: be.quantize_pair(x, spec[GemmRole.X_FPROP], spec[GemmRole.X_WGRAD], signs=signs,
                                     transient=(True, False))
    xq, xtq, _ = x_ops()
    dy_ops = lambda: be.quantize_pair(dy, spec[GemmRole.DY_DGRAD], spec[GemmRole.DY_WGRAD], seed=seed,
                                      row_offset=SR_OFFSETS[GemmRole.DY_DGRAD],
                                      col_offset=SR_OFFSETS[GemmRole.DY_WGRAD], signs=signs,
                                      transient=(True, True), prepare=xtq)
    dyq, dytq, xt_b = dy_ops()
    return {
        "quantize W (+W^T)": bench(lambda: be.prepare_weight(w, spec[GemmRole.W_FPROP], need_t=True)),
        "quantize X (+X^T RHT)": bench(x_ops),
        "quantize dY (+dY^T RHT, X^T dequantized)": bench(dy_ops),
        "fprop GEMM": bench(lambda: be.mm(xq, wq, bias=layer.bias, out_dtype=torch.bfloat16)),
        "dgrad GEMM": bench(lambda: be.mm(dyq, wtq, out_dtype=torch.bfloat16)),
        "wgrad GEMM": bench(lambda: be.mm(dytq, xt_b, out_dtype=torch.float32)),
    }


def run_shape(m: int, k: int, n: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    out = {"shape": [m, k, n], "bf16": {"ms": bench(fwd_bwd(ref, x, dy)),
                                        "peak_bytes": peak_memory(fwd_bwd(ref, x, dy)),
                                        **saved_split(ref, x)}}
    for name, recipe in RECIPES.items():
        layer = NVFP4Linear.from_module(nn.Linear(k, n, device="cuda"), recipe)
        step = fwd_bwd(layer, x, dy)
        ms = bench(step)
        out[name] = {"ms": ms, "ratio_to_bf16": ms / out["bf16"]["ms"],
                     "peak_bytes": peak_memory(step), **saved_split(layer, x),
                     "breakdown_ms": breakdown(layer, x.detach(), dy)}
    return out


def table(results) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = ["| shape (M, K, N) | recipe | fwd+bwd ms | x bf16 time | peak MiB | saved activations MiB "
             "| vs bf16 | saved weight copy MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        base = r["bf16"]
        for name in ("bf16", *RECIPES):
            v = r[name]
            lines.append(f"| {shape} | {'bf16 nn.Linear' if name == 'bf16' else 'NVFP4 ' + name} | "
                         f"{v['ms']:.3f} | {v['ms'] / base['ms']:.2f} | {v['peak_bytes'] / 2**20:.0f} | "
                         f"{mib(v['saved_activation_bytes'])} | "
                         f"{base['saved_activation_bytes'] / v['saved_activation_bytes']:.2f}x"
                         f"{'' if name == 'bf16' else ' smaller'} | "
                         f"{mib(v['saved_weight_copy_bytes'])} |")
    lines += ["", "| shape | piece (default recipe) | ms |", "| --- | --- | --- |"]
    for r in results:
        for piece, ms in r["default"]["breakdown_ms"].items():
            lines.append(f"| {'x'.join(map(str, r['shape']))} | {piece} | {ms:.3f} |")
    return "\n".join(lines)


def host_us(step, calls: int = 200) -> float:
    """Host time of one ``step()`` in µs: the mean over a loop of ``calls`` without synchronising
    (the launch queue never fills when the GPU work is tiny)."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_times(size: int = 256, profile: bool = False, rounds_: int = 9) -> dict:
    """Host µs per fwd+bwd of a (size x size) bf16 nn.Linear and of NVFP4Linear, same shapes: the
    median of ``rounds_`` rounds of :func:`host_us`; with ``profile`` also prints NVFP4Linear's
    host time by function (cProfile, self time)."""
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    bf16 = nn.Linear(size, size, device="cuda", dtype=torch.bfloat16)
    nvfp4 = NVFP4Linear.from_module(nn.Linear(size, size, device="cuda"), RECIPES["default"])
    # rounds alternate between the layers, medians: the host's times move by tens of percent
    # between rounds as the OS places the main and autograd threads on cores
    rounds = {"bf16": [], "nvfp4": []}
    for _ in range(rounds_):
        for name, layer in (("bf16", bf16), ("nvfp4", nvfp4)):
            rounds[name].append(host_us(fwd_bwd(layer, x, dy)))
    times = {name: statistics.median(t) for name, t in rounds.items()}
    if profile:
        import cProfile
        import pstats
        step = fwd_bwd(nvfp4, x, dy)
        with cProfile.Profile() as prof:
            for _ in range(100):
                step()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return times


def eval_times(shape: str) -> dict:
    """Milliseconds of one no-grad forward at ``shape`` (M x K x N, bf16 input): bf16 nn.Linear,
    NVFP4Linear (default recipe, fp32 master weight) quantizing W on every call, and the same
    layer inside ``cached_weights()``; checks that the cached output equals the uncached one."""
    m, k, n = map(int, shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    linear = nn.Linear(k, n, device="cuda")
    bf16 = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    layer = NVFP4Linear.from_module(linear, RECIPES["default"])
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        times = {"bf16": bench(lambda: bf16(x)), "nvfp4": bench(lambda: layer(x))}
        uncached = layer(x)
        with cached_weights():
            assert torch.equal(layer(x), uncached), "the cached weight gives another output"
            times["nvfp4 cached"] = bench(lambda: layer(x))
    return {"shape": [m, k, n], "ms": times}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["16384x4096x4096", "16384x4096x14336"])
    p.add_argument("--json", default="bench_linear.json")
    p.add_argument("--host", action="store_true", help="host time per call of a tiny layer only")
    p.add_argument("--profile", action="store_true", help="with --host: the host time by function")
    p.add_argument("--eval", action="store_true",
                   help="no-grad forwards, with and without cached_weights()")
    args = p.parse_args()
    if args.eval:
        shapes = args.shapes if args.shapes != p.get_default("shapes") else [
            "16x4096x4096", "16x4096x14336", "16384x4096x4096", "16384x4096x14336"]
        results = [eval_times(s) for s in shapes]
        write_json(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "eval": results})
        print("| shape (M, K, N) | bf16 ms | NVFP4 ms | cached ms | NVFP4 / bf16 | cached / bf16 |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for r in results:
            t = r["ms"]
            print(f"| {'x'.join(map(str, r['shape']))} | {t['bf16']:.4f} | {t['nvfp4']:.4f} | "
                  f"{t['nvfp4 cached']:.4f} | {t['nvfp4'] / t['bf16']:.2f} | "
                  f"{t['nvfp4 cached'] / t['bf16']:.2f} |")
        return
    if args.host:
        t = host_times(profile=args.profile)
        print(f"host time per fwd+bwd, 256x256x256: bf16 nn.Linear {t['bf16']:.0f} us, "
              f"NVFP4Linear {t['nvfp4']:.0f} us ({t['nvfp4'] / t['bf16']:.1f}x)")
        return
    results = [run_shape(*map(int, s.split("x"))) for s in args.shapes]
    write_json(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "results": results})
    print(table(results))


if __name__ == "__main__":
    main()

"""Grouped NVFP4 (mixture-of-experts) against bf16 ``torch._grouped_mm`` on one GPU.

Shape: G experts x tokens per expert, one grouped linear dim -> hidden (default 8 x 2048 tokens,
4096 -> 14336: T = 16384 tokens, W (8, 14336, 4096)). Measured in one run:

- fwd+bwd of ``moe.grouped_linear`` (the default recipe, bf16 activations; fp32 master weights,
  and bf16 weights as the baseline's) over fwd+bwd of bf16 ``torch._grouped_mm`` (autograd; bf16
  weights), the gradients of x and w returned by ``torch.autograd.grad`` (not accumulated), with the time of each piece (fp32 master weights) timed alone (expert weights W and
  W^T, X and X^T, dY and dY^T with W^T's dequantize pass riding along, the three grouped GEMMs;
  the transient copies, W among them, as fp16 inner values, as in training);
- fwd+bwd of a whole SwiGLU experts module (``moe.NVFP4GroupedExperts``, dim -> hidden -> dim,
  fp32 master weights) over the same experts in bf16 ``torch._grouped_mm``;
- the grouped quantize kernels' bandwidth: bytes a pass must move (input read once, codes and
  scales or inner values written once) over its median time, as a fraction of a device-to-device
  copy of 2 GiB measured in the same run (the target: >= 60%); the amax pass and the quantize pass
  apart and together.

Prints a table and writes JSON. ``--tiny`` runs small shapes on the CPU (Triton interpreter, a
perf_counter loop instead of ``do_bench``): a smoke test of the script, not a measurement.
``--sweep`` also times the three grouped GEMMs under a few tile configs (for tuning
``kernels.grouped_gemm.GROUPED_GEMM_CONFIG``).

    python benchmarks/bench_moe.py [--experts 8] [--tokens 2048] [--dim 4096] [--hidden 14336]
                                   [--json bench_moe.json] [--sweep] [--tiny]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SWEEP = [dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, P=1),
         dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, P=1),
         dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4, P=2),
         dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4, P=2)]


def timer(tiny: bool):
    """Median milliseconds of a callable: ``do_bench`` on a GPU, a short perf_counter loop for
    --tiny on the CPU."""
    if not tiny:
        from common import median_ms
        return lambda fn: median_ms(fn, warmup=50, rep=300)

    def cpu_ms(fn, reps=3):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[reps // 2]
    return cpu_ms


def copy_gbps(device, tiny: bool, bench) -> float:
    """Bandwidth of a device-to-device copy (bytes read + written), GB/s, in this run."""
    import torch
    n = (8 << 20) if tiny else (2 << 30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / bench(lambda: dst.copy_(src)) / 1e6


def run(args) -> dict:
    import torch
    from nvfp4_recipe import NVFP4Recipe, moe
    from nvfp4_recipe.backends import get_backend
    from nvfp4_recipe.kernels import grouped_gemm
    from nvfp4_recipe.recipe import SR_OFFSETS
    from nvfp4_recipe.spec import GemmRole

    device = torch.device("cpu" if args.tiny else "cuda")
    bench = timer(args.tiny)
    g, tpe, k, n = args.experts, args.tokens, args.dim, args.hidden
    t = g * tpe
    torch.manual_seed(0)
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    w = (torch.randn(g, n, k, device=device) / k**0.5).requires_grad_()
    w16 = w.detach().to(torch.bfloat16).requires_grad_()
    offs = torch.arange(1, g + 1, device=device, dtype=torch.int32) * tpe
    recipe = NVFP4Recipe(backend="triton")
    signs = recipe.signs().to(device)
    seed, step = torch.tensor(7, device=device), torch.tensor(0, device=device)

    # torch.autograd.grad: the gradients are computed, not accumulated into .grad (as after
    # optimizer.zero_grad(), whose default sets them to None)
    def bf16_step():
        torch.autograd.grad(torch._grouped_mm(x, w16.transpose(-2, -1), offs=offs), (x, w16), dy)

    def nvfp4_step(weights):
        return lambda: torch.autograd.grad(
            moe.grouped_linear(x, weights, offs, recipe, signs, seed, step), (x, weights), dy)

    out = {"shape": {"experts": g, "tokens_per_expert": tpe, "dim": k, "hidden": n},
           "bf16_ms": bench(bf16_step), "nvfp4_ms": bench(nvfp4_step(w)),
           "nvfp4_bf16_weights_ms": bench(nvfp4_step(w16))}
    out["ratio"] = out["nvfp4_ms"] / out["bf16_ms"]
    out["ratio_bf16_weights"] = out["nvfp4_bf16_weights_ms"] / out["bf16_ms"]

    gb = get_backend("triton", device)
    spec = {role: recipe.spec(role) for role in GemmRole}
    xd = x.detach()
    w_pair = lambda: gb.quantize_experts(w.detach(), spec[GemmRole.W_FPROP], need_t=True,
                                         transient=True)
    wq, wt = w_pair()
    x_pair = lambda: gb.quantize_groups(xd, offs, spec[GemmRole.X_FPROP], spec[GemmRole.X_WGRAD],
                                 signs=signs, transient=(True, False))
    dy_pair = lambda: gb.quantize_groups(dy, offs, spec[GemmRole.DY_DGRAD], spec[GemmRole.DY_WGRAD],
                                  seed=seed, row_offset=SR_OFFSETS[GemmRole.DY_DGRAD],
                                  col_offset=SR_OFFSETS[GemmRole.DY_WGRAD], signs=signs,
                                  transient=(True, True), prepare=wt)
    (xq, xt, _), (dyq, dyt, wt_in) = x_pair(), dy_pair()
    mm = grouped_gemm.grouped_scaled_mm
    gemms = {"fprop GEMM": lambda cfg=None: mm(xq, wq, out_dtype=torch.bfloat16, cfg=cfg),
             "dgrad GEMM": lambda cfg=None: mm(dyq, wt_in, out_dtype=torch.bfloat16, cfg=cfg),
             "wgrad GEMM": lambda cfg=None: mm(dyt, xt, out_dtype=torch.float32, cfg=cfg)}
    out["breakdown_ms"] = {
        "quantize W inner + W^T, per expert": bench(w_pair),
        "quantize X inner + X^T RHT": bench(x_pair),
        "quantize dY inner SR + dY^T RHT SR inner, W^T dequantized": bench(dy_pair),
        **{name: bench(fn) for name, fn in gemms.items()}}
    if args.sweep:
        out["sweep_ms"] = [{"config": cfg, **{name: bench(lambda fn=fn: fn(cfg))
                                              for name, fn in gemms.items()}} for cfg in SWEEP]
    out["quantize"] = quantize_bandwidth(xd, dy, offs, spec, signs, seed, bench, device, args.tiny)
    out["experts_module"] = experts_module(g, tpe, k, n, device, bench)
    return out


def experts_module(g: int, tpe: int, dim: int, hidden: int, device, bench) -> dict:
    """fwd+bwd of ``moe.NVFP4GroupedExperts`` (torchtitan's SwiGLU experts layout, fp32 master
    weights, the default recipe) over the same SwiGLU experts in bf16 ``torch._grouped_mm``
    (bf16 weights), both on bf16 tokens, gradients by ``torch.autograd.grad``."""
    import torch
    import torch.nn.functional as F
    from nvfp4_recipe import NVFP4Recipe, moe

    torch.manual_seed(1)
    x = torch.randn(g * tpe, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(g * tpe, dim, device=device, dtype=torch.bfloat16)
    counts = torch.full((g,), tpe, device=device, dtype=torch.float32)
    offs = torch.arange(1, g + 1, device=device, dtype=torch.int32) * tpe
    m = moe.NVFP4GroupedExperts(dim, hidden, g, NVFP4Recipe(backend="triton"), device=device)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    w1, w2, w3 = (p.detach().to(torch.bfloat16).requires_grad_() for p in (m.w1, m.w2, m.w3))
    mm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

    def bf16_step():
        torch.autograd.grad(mm(F.silu(mm(x, w1)) * mm(x, w3), w2), (x, w1, w2, w3), dy)

    def nvfp4_step():
        torch.autograd.grad(m(x, counts), (x, m.w1, m.w2, m.w3), dy)
    out = {"bf16_ms": bench(bf16_step), "nvfp4_ms": bench(nvfp4_step)}
    return {**out, "ratio": out["nvfp4_ms"] / out["bf16_ms"]}


def quantize_bandwidth(x, dy, offs, spec, signs, seed, bench, device, tiny) -> dict:
    """GB/s and % of copy of the grouped amax and quantize passes (module docstring)."""
    from nvfp4_recipe.kernels.grouped_amax import grouped_amax_pass
    from nvfp4_recipe.kernels.grouped_quantize import quantize_grouped
    from nvfp4_recipe.spec import GemmRole

    copy = copy_gbps(device, tiny, bench)
    rows = []
    for name, t, row, col, sr, inner in (
            ("X codes + X^T RHT codes", x, GemmRole.X_FPROP, GemmRole.X_WGRAD, False, (False, False)),
            ("dY SR codes + dY^T RHT SR codes", dy, GemmRole.DY_DGRAD, GemmRole.DY_WGRAD, True,
             (False, False)),
            ("X inner + X^T RHT codes (training)", x, GemmRole.X_FPROP, GemmRole.X_WGRAD, False,
             (True, False))):
        r, c = spec[row], spec[col]
        n = t.numel()
        copy_bytes = lambda inner_: 2 * n if inner_ else n // 2 + n // 16
        write = copy_bytes(inner[0]) + copy_bytes(inner[1])
        amaxes = grouped_amax_pass(t, offs, r, c, signs)
        kw = dict(seed=seed if sr else 0, signs=signs, inner=inner)
        passes = {"amax pass": (lambda: grouped_amax_pass(t, offs, r, c, signs), 2 * n),
                  "quantize pass": (lambda: quantize_grouped(t, offs, r, c, amaxes=amaxes, **kw),
                                    2 * n + write),
                  "both": (lambda: quantize_grouped(t, offs, r, c, **kw), 4 * n + write)}
        for what, (fn, nbytes) in passes.items():
            ms = bench(fn)
            gbps = nbytes / ms / 1e6
            rows.append({"operand": name, "pass": what, "ms": ms, "GB/s": gbps,
                         "% of copy": 100 * gbps / copy})
    return {"copy_GBps": copy, "rows": rows}


def table(out: dict) -> str:
    from common import markdown_table
    s = out["shape"]
    lines = [f"grouped linear {s['experts']} experts x {s['tokens_per_expert']} tokens, "
             f"{s['dim']} -> {s['hidden']}",
             f"fwd+bwd: bf16 torch._grouped_mm {out['bf16_ms']:.3f} ms; NVFP4 "
             f"{out['nvfp4_ms']:.3f} ms with fp32 master weights ({out['ratio']:.2f}x bf16), "
             f"{out['nvfp4_bf16_weights_ms']:.3f} ms with bf16 weights "
             f"({out['ratio_bf16_weights']:.2f}x); target <= 1.2x"]
    e = out["experts_module"]
    lines += [f"SwiGLU experts module (NVFP4GroupedExperts, {s['dim']} -> {s['hidden']} -> "
              f"{s['dim']}) fwd+bwd: bf16 {e['bf16_ms']:.3f} ms, NVFP4 {e['nvfp4_ms']:.3f} ms "
              f"({e['ratio']:.2f}x bf16)", ""]
    lines.append(markdown_table([{"piece": p, "ms": ms} for p, ms in out["breakdown_ms"].items()],
                                ["piece", "ms"]))
    if "sweep_ms" in out:
        lines += ["", markdown_table([{"config": str(r["config"]), **r} for r in out["sweep_ms"]],
                                     ["config", "fprop GEMM", "dgrad GEMM", "wgrad GEMM"])]
    q = out["quantize"]
    lines += ["", f"device-to-device copy: {q['copy_GBps']:.0f} GB/s (target: quantize >= 60%)",
              markdown_table(q["rows"], ["operand", "pass", "ms", "GB/s", "% of copy"])]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--json", default="bench_moe.json")
    p.add_argument("--sweep", action="store_true", help="also time the GEMMs under SWEEP's configs")
    p.add_argument("--tiny", action="store_true",
                   help="small shapes on the CPU under the Triton interpreter (a smoke test)")
    args = p.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read by Triton at import
        args.experts, args.tokens, args.dim, args.hidden = 4, 32, 64, 96
    from common import environment, write_json
    out = run(args)
    write_json(args.json, {"environment": environment(), "tiny": args.tiny, **out})
    print(table(out))


if __name__ == "__main__":
    main()

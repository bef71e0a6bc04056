"""NVFP4 GEMM benchmark: TFLOP/s of each method of nvfp4_recipe.kernels.gemm.scaled_mm against bf16
``torch.mm`` measured in the same run, beside torchao 0.18's emulation (the peer).

For (M, K, N) in SHAPES, D = A @ B^T with A (M, K) and B (N, K) NVFP4 operands (random codes, random
E4M3 block scales, per-tensor outer scales), bf16 output. Rows:

- ``bf16 torch.mm``: cuBLAS on the exactly dequantized bf16 operands; the denominator of every
  fraction (timed first and last: the spread of the two is the run's noise).
- ``torchao emulation``: torchao 0.18 ``NVFP4Tensor`` dequantize both operands to bf16, then
  ``torch.mm`` (what its NVFP4 matmul does off Blackwell), on its own quantization of random data.
- ``triton``, ``cublas``: the methods of ``scaled_mm``; ``triton`` for every tile config of the
  sweep (the default config is marked); ``fused`` (``fused_gemm.py``), an experiment kept here:
  the dequantization inside the GEMM's main loop.
- ``dequant + bf16 mm + scale``: cuBLAS bf16 output scaled afterwards (rounds twice; not offered by
  the library, shown as the cost of skipping the fp32 epilogue).
- components of the two-pass methods: dequantize A and B, cuBLAS fp16 -> fp32 product, epilogue;
  the dequantize pass in GB/s against a device-to-device copy.

Each method's output is checked against the fp32 emulated GEMM before it is timed. Times are
``triton.testing.do_bench`` medians (``common.median_ms``). Prints a table last and writes JSON (``--json``).
Usage: python benchmarks/bench_gemm.py [--json PATH] [--quick]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_gbps, median_ms  # noqa: E402
from fused_gemm import FUSED_CONFIG, fused_mm  # noqa: E402
from nvfp4_recipe.kernels import gemm  # noqa: E402
from nvfp4_recipe.kernels import dequantize as D  # noqa: E402
from nvfp4_recipe.operand import NVFP4Operand  # noqa: E402

SHAPES = ((16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096))
# Not in the target: the wgrad GEMM of a 4096 x 4096 layer (K = tokens), default configs only.
EXTRA_SHAPES = ((4096, 16384, 4096),)
FUSED_SWEEP = (
    dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
)
GEMM_SWEEP = (
    dict(BM=128, BN=256, BK=64, GROUP_M=16, EPI_SPLIT=1, num_warps=8, num_stages=3, P=1),
    dict(BM=128, BN=256, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=8, num_stages=3, P=1),
    dict(BM=128, BN=256, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=8, num_stages=4, P=1),
    dict(BM=256, BN=128, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=8, num_stages=3, P=1),
    dict(BM=128, BN=256, BK=64, GROUP_M=16, EPI_SPLIT=2, num_warps=8, num_stages=3, P=1),
    dict(BM=128, BN=128, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=4, num_stages=3, P=2),
)
DEQUANT_SWEEP = (
    dict(BR=32, BK=256, num_warps=4),
    dict(BR=32, BK=128, num_warps=4),
    dict(BR=64, BK=128, num_warps=4),
    dict(BR=64, BK=256, num_warps=8),
    dict(BR=128, BK=128, num_warps=8),
)


def bench_ms(fn) -> float:
    """Median milliseconds (one untimed-warm-up run and one timed run off CUDA: smoke tests only)."""
    if not torch.cuda.is_available():
        import time
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return median_ms(fn)


def random_operand(rows, k, device, gen) -> NVFP4Operand:
    q = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device=device, generator=gen)
    s = torch.exp2(torch.rand(rows, k // 16, device=device, generator=gen) * 8 - 4)
    outer = torch.full((), 1e-3, device=device)
    return NVFP4Operand(q, s.to(torch.float8_e4m3fn), outer)


def inner_pair(a, b, cfg=None):
    """A_inner and B_inner in fp16 (the dequantize passes of the two-pass GEMM)."""
    return (D.dequantize_inner(a, torch.float16, cfg), D.dequantize_inner(b, torch.float16, cfg))


def sass_summary(kernel) -> dict:
    """Registers, spills and the count of HGMMA / HMMA instructions of a compiled Triton kernel."""
    info = dict(n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
                wgmma_in_ptx="wgmma.mma_async" in kernel.asm.get("ptx", ""))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        try:
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        except OSError as e:
            return dict(info, sass_error=str(e))
    first = next((line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines()
                  if "HGMMA" in line), "")
    return dict(info, HGMMA=sass.count("HGMMA"), HMMA=sass.count(" HMMA"), first_hgmma=first)


def torchao_peer(m, k, n, device):
    """torchao 0.18's emulated NVFP4 matmul: dequantize both NVFP4Tensors to bf16, torch.mm."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    xq = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
    wq = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max()))
    return lambda: torch.mm(xq.dequantize(torch.bfloat16), wq.dequantize(torch.bfloat16).t())


def two_pass_triton(a, b, cfg):
    """The "triton" method with a given GEMM config (bf16 output)."""
    a16, b16 = inner_pair(a, b)
    return gemm.triton_mm(a16, a.outer_scale, b16, b.outer_scale, None, torch.bfloat16, cfg)


def compiled_triton(a, b, cfg):
    """The compiled TMA GEMM that :func:`two_pass_triton` launched with ``cfg``."""
    a16, b16 = inner_pair(a, b)
    _, _, args, kwargs = gemm._gemm_launch(a16, a.outer_scale, b16, b.outer_scale, None,
                                           torch.bfloat16, cfg)
    return gemm._GEMM.compiled(*args, **kwargs)


def rel_error(out, ref) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def bench_shape(m, k, n, device, quick, sass):
    gen = torch.Generator(device=device).manual_seed(m + k + n)
    a, b = random_operand(m, k, device, gen), random_operand(n, k, device, gen)
    a_bf = D.dequantize_inner(a)
    b_bf = D.dequantize_inner(b)
    scale = a.outer_scale * b.outer_scale
    ref = scale * torch.mm(a_bf.float(), b_bf.float().t())
    flop = 2.0 * m * n * k
    rows = []

    def row(name, fn, config="", check=True):
        err = rel_error(fn(), ref) if check else None
        ms = bench_ms(fn)
        rows.append(dict(variant=name, config=config, ms=ms, tflops=flop / ms / 1e9, rel_err=err))

    row("bf16 torch.mm", lambda: torch.mm(a_bf, b_bf.t()), check=False)
    row("torchao emulation", torchao_peer(m, k, n, device), check=False)
    kernels = {}
    for method, sweep, default in (("fused", FUSED_SWEEP, FUSED_CONFIG),
                                   ("triton", GEMM_SWEEP, gemm.gemm_config(k, torch.bfloat16))):
        for cfg in ((default,) if quick else sweep):
            if method == "fused":
                def fn(cfg=cfg):
                    out, kernels["fused"] = fused_mm(a, b, None, torch.bfloat16, cfg)
                    return out
            else:
                fn = lambda cfg=cfg: two_pass_triton(a, b, cfg)
            tag = "x".join(str(cfg[x]) for x in ("BM", "BN", "BK")) + \
                f" w{cfg['num_warps']} s{cfg['num_stages']} g{cfg['GROUP_M']}" + \
                (f" e{cfg['EPI_SPLIT']}" if "EPI_SPLIT" in cfg else "") + \
                (f" p{cfg['P']}" if cfg.get("P", 1) > 1 else "") + (" *" if cfg == default else "")
            try:
                row(method, fn, tag)
            except Exception as e:  # a config that does not fit (shared memory, registers)
                rows.append(dict(variant=method, config=tag, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            if cfg == default and method not in sass and device.type == "cuda":
                sass[method] = sass_summary(kernels.get(method) or compiled_triton(a, b, cfg))
    row("cublas", lambda: gemm.scaled_mm(a, b, method="cublas"))
    row("dequant + bf16 mm + scale (2 roundings)",
        lambda: (torch.mm(D.dequantize_inner(a), D.dequantize_inner(b).t()) * scale).to(torch.bfloat16))
    at = a._replace(outer_scale=a.outer_scale.expand(m).contiguous())
    bt = b._replace(outer_scale=b.outer_scale.expand(n).contiguous())
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    ref_tok = ref + bias.float()
    err = rel_error(gemm.scaled_mm(at, bt, bias=bias), ref_tok)
    ms = bench_ms(lambda: gemm.scaled_mm(at, bt, bias=bias))
    rows.append(dict(variant="auto, per-token scales + bias", ms=ms, tflops=flop / ms / 1e9, rel_err=err))
    row("auto, fp32 output", lambda: gemm.scaled_mm(a, b, out_dtype=torch.float32))
    a16, b16 = inner_pair(a, b)
    c = gemm.mm_f32(a16, b16)
    deq_bytes = (m + n) * k * (0.5 + 1 / 16 + 2)
    for cfg in ((D.DEQUANT_CONFIG,) if quick else DEQUANT_SWEEP):
        deq_ms = bench_ms(lambda: inner_pair(a, b, cfg))
        tag = f"{cfg['BR']}x{cfg['BK']} w{cfg['num_warps']}" + (" *" if cfg == D.DEQUANT_CONFIG else "")
        rows.append(dict(variant="  dequantize A and B (fp16)", config=tag, ms=deq_ms,
                         gbps=deq_bytes / deq_ms / 1e6))
    rows.append(dict(variant="  cuBLAS fp16 -> fp32", ms=bench_ms(lambda: gemm.mm_f32(a16, b16))))
    epi_ms = bench_ms(lambda: gemm.apply_epilogue(c, a.outer_scale, b.outer_scale, None,
                                                  torch.bfloat16))
    rows.append(dict(variant="  epilogue fp32 -> bf16", ms=epi_ms, gbps=6 * m * n / epi_ms / 1e6))
    row("bf16 torch.mm (again)", lambda: torch.mm(a_bf, b_bf.t()), check=False)
    base = rows[0]["tflops"]
    for r in rows:
        if "tflops" in r:
            r["frac_bf16_mm"] = r["tflops"] / base
    return dict(shape=dict(M=m, K=k, N=n), rows=rows)


def print_table(results, copy):
    print(f"\ndevice-to-device copy: {copy:.0f} GB/s")
    print(f"{'M,K,N':>18} {'variant':<42} {'config':<22} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7} "
          f"{'rel.err':>8} {'GB/s':>6}")
    for res in results:
        s = res["shape"]
        shape = f"{s['M']},{s['K']},{s['N']}"
        for r in res["rows"]:
            if "error" in r:
                print(f"{shape:>18} {r['variant']:<42} {r['config']:<22} failed: {r['error'][:60]}")
                continue
            tf = f"{r['tflops']:8.1f} {r['frac_bf16_mm']:7.3f}" if "tflops" in r else " " * 16
            err = f"{r['rel_err']:8.1e}" if r.get("rel_err") is not None else " " * 8
            gb = f"{r['gbps']:6.0f}" if r.get("gbps") else ""
            print(f"{shape:>18} {r['variant']:<42} {r.get('config', ''):<22} {r['ms']:8.3f} {tf} {err} {gb}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="bench_gemm.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="default tile configs only")
    parser.add_argument("--shapes", nargs="*", default=None, help="M,K,N triples (default: SHAPES)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: interpreter smoke test
    torch.backends.cuda.matmul.allow_tf32 = False
    copy = copy_gbps(device=device) if device.type == "cuda" else float("nan")
    sass = {}
    results = [bench_shape(m, k, n, device, args.quick, sass) for m, k, n in shapes]
    if not args.shapes:
        results += [bench_shape(m, k, n, device, True, sass) for m, k, n in EXTRA_SHAPES]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    meta = dict(device=name, torch=torch.__version__,
                triton=triton.__version__, copy_gbps=copy, sass=sass)
    with open(args.json, "w") as f:
        json.dump(dict(meta, results=results), f, indent=1)
    print("SASS of the default configs:", json.dumps(sass))
    print_table(results, copy)


if __name__ == "__main__":
    main()

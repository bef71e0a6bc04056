"""A whole training step under bf16, the default NVFP4 recipe and torchao's float8 training.

Models: ``preset`` is the ``train --preset gpu`` model (38M parameters, d_model 512, 32k tokens a
step); ``wide`` is d_model 2048, d_ff 8192, 4 layers, 16k tokens a step, where the linears are large
enough for the GEMMs to dominate; ``moe`` is the preset with every feed-forward layer a mixture
of 8 SwiGLU experts, 2 per token (bf16: ``torch._grouped_mm``; NVFP4: the grouped kernels). Step = forward + cross-entropy + backward + AdamW step, bf16
autocast, on random byte tokens. Reports the median step time, tokens/s and peak memory in three
modes: eager, ``torch.compile``d (each transformer block compiled on its own, as torchtitan does:
the blocks share one compiled graph, so compilation costs one block's; ``--compile model``
compiles the whole model instead), and the whole eager step captured in one CUDA graph and replayed
(AdamW with ``capturable=True`` in every mode, as the main job), and the wall time of the first
step (with torch.compile's compilation, or the graph's warm-up and capture). The peers, torchao's float8
training with rowwise and tensorwise scales (``convert_to_float8_training``, the same linears as
NVFP4: all but ``lm_head``), run compiled only, the mode torchao supports for speed. Ratios are to
bf16 in the same mode, from the same run. Prints a table and writes JSON.

    python benchmarks/bench_train_step.py [--json out.json] [--models preset wide]
        [--modes eager compiled graph] [--recipes nvfp4 nvfp4-4over6 ...]
        [--compile blocks|model] [--no-peers] [--profile] [--warm-cache]

``--profile`` also prints each mode's GPU time per kernel (torch.profiler; in graph mode, of the
replays). The first steps are those of a machine that never ran these models: the run compiles
into empty Inductor and Triton caches of its own (``--warm-cache`` keeps the usual ones, which
earlier runs, or other processes running at the same time, may have filled). In compiled mode a
second process then builds and compiles the same model from the caches the first compile filled:
the first step of a later run on the same machine (with torch's opt-in that lets AOTAutograd's
cache hold graphs with autograd Functions, which the NVFP4 layers use).
"""

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from common import environment, median_ms, write_json
from nvfp4_recipe.blocks import repeated_blocks
from nvfp4_recipe.train.loop import build_model, lm_loss, make_optimizer
from nvfp4_recipe.train.model import count_params
from nvfp4_recipe.train.config import RECIPES as JOB_RECIPES
from nvfp4_recipe.train.presets import preset_config

RECIPES = ("bf16", "nvfp4")  # the default; --recipes adds the main job's others (bf16 always runs)
PEERS = ("float8-rowwise", "float8-tensorwise")  # torchao, compiled only
MODES = ("eager", "compiled", "graph")
MODELS = {"preset": {},
          "wide": dict(d_model=2048, d_ff=8192, n_layers=4, n_heads=16, seq_len=1024, batch_size=16),
          "moe": dict(n_experts=8, top_k=2)}


def print_gpu_time(run, recipe: str, mode: str, steps: int = 5, top: int = 12) -> None:
    """GPU time per step of the kernels of ``run`` (torch.profiler), grouped by kernel name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels)
    print(f"\nGPU time per step, {recipe} {mode}: {total / steps / 1e3:.2f} ms")
    print("| kernel | ms per step | share | calls per step |\n| --- | --- | --- | --- |")
    for e in kernels[:top]:
        print(f"| {e.key[:70]} | {e.device_time_total / steps / 1e3:.2f} | "
              f"{100 * e.device_time_total / total:.0f}% | {e.count // steps} |")


def cuda_graph(step):
    """``step`` captured in a CUDA graph (after warm-up steps on a side stream); returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def float8_model(cfg, name: str, device) -> torch.nn.Module:
    """The bf16 baseline model with torchao's float8 training on every linear but ``lm_head``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = build_model(cfg, "bf16", device)
    config = Float8LinearConfig.from_recipe_name(name.removeprefix("float8-"))
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda mod, fqn: fqn != "lm_head")


def compiled(model: torch.nn.Module, scope: str) -> torch.nn.Module:
    """``model`` compiled whole (``scope`` "model") or one repeated block at a time ("blocks")."""
    if scope == "model":
        return torch.compile(model)
    for _, block in repeated_blocks(model):
        block.compile()
    return model


def build_step(model_name: str, recipe: str, mode: str, scope: str = "blocks"):
    """(step, model, cfg): one training step of a new model, compiled in "compiled" mode."""
    cfg = preset_config("gpu", **MODELS[model_name])
    device = torch.device("cuda")
    if recipe in PEERS:
        model = float8_model(cfg, recipe, device)
    else:
        model = build_model(cfg, recipe, device)
    opt, _ = make_optimizer(model, cfg)  # capturable on CUDA in every mode, as the main job
    fwd = compiled(model, scope) if mode == "compiled" else model
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)
    y = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)

    def step():
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=mode != "graph"):
            loss = lm_loss(fwd, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model, cfg


def first_step(step, mode: str):
    """(run, seconds): the step to time (the replay of its CUDA graph in "graph" mode) and the wall
    time of its first run, with torch.compile's compilation or the graph's warm-up and capture."""
    start = time.perf_counter()
    run = cuda_graph(step) if mode == "graph" else step
    run()
    torch.cuda.synchronize()
    return run, time.perf_counter() - start


def measure(model_name: str, recipe: str, mode: str, profile: bool = False,
            scope: str = "blocks") -> dict:
    step, model, cfg = build_step(model_name, recipe, mode, scope)
    if mode == "graph":  # the graph's memory pool is allocated at capture: count from there
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    run, first_s = first_step(step, mode)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    if mode != "graph":
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(run, warmup=100, rep=1000)
    if profile:
        print_gpu_time(run, recipe, mode)
    r = {"ms": ms, "first_step_s": first_s,
         "tokens_per_s": cfg.batch_size * cfg.seq_len / ms * 1e3,
         "peak_bytes": torch.cuda.max_memory_allocated(), "params": count_params(model)}
    torch._dynamo.reset()  # each compiled model starts from a clean cache
    if mode == "compiled":
        r["rerun_first_step_s"] = later_run_first_step(model_name, recipe, scope)
    return r


def later_run_first_step(model_name: str, recipe: str, scope: str) -> float:
    """The first compiled step of a new process that builds and compiles the same model from the
    caches this one filled (the environment's cache directories)."""
    out = subprocess.run([sys.executable, __file__, "--later-run", model_name, recipe,
                          "--compile", scope], check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def runs(models, modes, recipes, peers: bool):
    """(model, recipe, mode) triples to measure: bf16 and the recipes in each mode, the peers
    compiled."""
    for model in models:
        for mode in modes:
            for recipe in recipes + (PEERS if peers and mode == "compiled" else ()):
                yield model, recipe, mode


def empty_compile_caches() -> None:
    """Point Inductor's and Triton's caches (read when a graph or kernel is first compiled) at
    subdirectories of a new temporary directory, removed when the process exits."""
    root = tempfile.mkdtemp(prefix="bench_train_step_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = os.path.join(root, sub)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench_train_step.json")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--recipes", nargs="+", choices=list(JOB_RECIPES), default=list(RECIPES[1:]),
                   help="the main job's recipes to time beside bf16 (default: nvfp4)")
    p.add_argument("--compile", choices=("blocks", "model"), default="blocks",
                   help="compiled mode: each transformer block on its own (default) or the whole model")
    p.add_argument("--no-peers", action="store_true", help="skip torchao's float8 training")
    p.add_argument("--profile", action="store_true",
                   help="also print the GPU time of each kernel of each mode's steps")
    p.add_argument("--warm-cache", action="store_true",
                   help="compile into the usual Inductor and Triton caches, not empty ones")
    p.add_argument("--later-run", nargs=2, metavar=("MODEL", "RECIPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    # torch's opt-in (TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=1) that lets a later run
    # load the NVFP4 layers' compiled graphs, which contain an autograd Function, from the cache
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    if args.later_run:  # the child of later_run_first_step: its caches are the parent's
        print(first_step(build_step(*args.later_run, "compiled", args.compile)[0], "compiled")[1])
        return
    if not args.warm_cache:
        empty_compile_caches()
    results = {}
    recipes = ("bf16",) + tuple(r for r in args.recipes if r != "bf16")
    for model, recipe, mode in runs(args.models, args.modes, recipes, not args.no_peers):
        results[f"{model} {recipe} {mode}"] = r = measure(model, recipe, mode, args.profile, args.compile)
        rerun = f", a later run's {r['rerun_first_step_s']:.1f} s" if mode == "compiled" else ""
        print(f"{model} {recipe} {mode}: {r['ms']:.2f} ms, first step {r['first_step_s']:.1f} s{rerun}",
              flush=True)
    write_json(args.json, {**environment(), "compile": args.compile,
                           "warm_cache": args.warm_cache, "results": results,
                           "models": {m: vars(preset_config("gpu", **MODELS[m])) for m in args.models}})
    print("| model | recipe | mode | step ms | x bf16 (same mode) | first step s | a later run's s "
          "| tokens/s | peak GiB |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        model, recipe, mode = name.split()
        base = results[f"{model} bf16 {mode}"]
        print(f"| {model} | {recipe} | {mode} | {r['ms']:.2f} | {r['ms'] / base['ms']:.2f} | "
              f"{r['first_step_s']:.1f} | {r.get('rerun_first_step_s', float('nan')):.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()

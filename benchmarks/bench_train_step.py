"""A whole training step of the ``train --preset gpu`` model under bf16 and the default NVFP4 recipe.

Step = forward + cross-entropy + backward + AdamW step, bf16 autocast, on random byte tokens of the
preset's batch shape. Reports the median step time, tokens/s and peak memory of each recipe in three
modes: eager, ``torch.compile``d, and the whole eager step captured in one CUDA graph and replayed
(AdamW with ``capturable=True``; this removes the host-side cost of launching the many small
kernels, so it shows what the GPU work itself costs). Ratios are NVFP4/bf16 within a mode, from the
same run. Prints a table and writes JSON.

    python benchmarks/bench_train_step.py [--json out.json] [--modes eager compiled graph] [--profile]

``--profile`` also prints each mode's GPU time per kernel (torch.profiler; in graph mode, of the
replays).
"""

import argparse

import torch

from common import median_ms, write_json
from nvfp4_recipe.train.loop import build_model, lm_loss, make_optimizer
from nvfp4_recipe.train.model import count_params
from nvfp4_recipe.train.presets import preset_config

RECIPES = ("bf16", "nvfp4")
MODES = ("eager", "compiled", "graph")


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


def measure(recipe: str, mode: str, profile: bool = False) -> dict:
    cfg = preset_config("gpu")
    device = torch.device("cuda")
    model = build_model(cfg, recipe, device)
    opt, _ = make_optimizer(model, cfg)  # capturable on CUDA in every mode, as the main job
    fwd = torch.compile(model) if mode == "compiled" else model
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)
    y = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)

    def step():
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=mode != "graph"):
            loss = lm_loss(fwd, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if mode == "graph":  # the graph's memory pool is allocated at capture: count from there
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    run = cuda_graph(step) if mode == "graph" else step
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    if mode != "graph":
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(run, warmup=100, rep=1000)
    if profile:
        print_gpu_time(run, recipe, mode)
    return {"ms": ms, "tokens_per_s": cfg.batch_size * cfg.seq_len / ms * 1e3,
            "peak_bytes": torch.cuda.max_memory_allocated(), "params": count_params(model)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench_train_step.json")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--profile", action="store_true",
                   help="also print the GPU time of each kernel of each mode's steps")
    args = p.parse_args()
    results = {f"{r} {m}": measure(r, m, args.profile)
               for m in args.modes for r in RECIPES}
    write_json(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "config": vars(preset_config("gpu")), "results": results})
    print("| recipe, mode | step ms | x bf16 (same mode) | tokens/s | peak GiB |\n| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        base = results[name.replace("nvfp4", "bf16")]
        print(f"| {name} | {r['ms']:.2f} | {r['ms'] / base['ms']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()

"""A whole training step of the ``train --preset gpu`` model under bf16 and the default NVFP4 recipe.

Step = forward + cross-entropy + backward + AdamW step, bf16 autocast, on random byte tokens of the
preset's batch shape. Reports the median step time, tokens/s and peak memory of each recipe, eager
and ``torch.compile``d, and the NVFP4/bf16 ratios of the same run. Prints a table and writes JSON.

    python benchmarks/bench_train_step.py [--json out.json] [--no-compile]
"""

import argparse
import json

import torch
from triton.testing import do_bench

from nvfp4_recipe.train.loop import build_model, lm_loss, make_optimizer
from nvfp4_recipe.train.model import count_params
from nvfp4_recipe.train.presets import preset_config

RECIPES = ("bf16", "nvfp4")


def measure(recipe: str, compile_: bool) -> dict:
    cfg = preset_config("gpu")
    device = torch.device("cuda")
    model = build_model(cfg, recipe, device)
    opt, _ = make_optimizer(model, cfg)
    fwd = torch.compile(model) if compile_ else model
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)
    y = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device, generator=g)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = lm_loss(fwd, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = do_bench(step, warmup=100, rep=1000, return_mode="median")
    return {"ms": ms, "tokens_per_s": cfg.batch_size * cfg.seq_len / ms * 1e3,
            "peak_bytes": torch.cuda.max_memory_allocated(), "params": count_params(model)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench_train_step.json")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args()
    modes = [False] if args.no_compile else [False, True]
    results = {f"{r}{' compiled' if c else ''}": measure(r, c) for c in modes for r in RECIPES}
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "config": vars(preset_config("gpu")), "results": results}, f, indent=1)
    print("| recipe | step ms | x bf16 (same mode) | tokens/s | peak GiB |\n| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        base = results[name.replace("nvfp4", "bf16")]
        print(f"| {name} | {r['ms']:.2f} | {r['ms'] / base['ms']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()

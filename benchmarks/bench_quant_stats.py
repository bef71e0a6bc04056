"""What ``--quant-stats-every N`` (``inspect.QuantStats``) costs on the GPU preset model: a step
that records the statistics runs eagerly with its operands quantized once more and their
statistics computed, in place of a CUDA-graph replay. Reports the graph step, the eager step and the
recorded step, and the cost per step at every N steps as a share of the graph step, all from
one run.

    python benchmarks/bench_quant_stats.py [--every 100 200] [--json out.json]
"""

import argparse

import torch

from bench_train_step import cuda_graph
from common import environment, median_ms, write_json
from nvfp4_recipe.inspect import QuantStats
from nvfp4_recipe.train.loop import build_model, lm_loss, make_optimizer
from nvfp4_recipe.train.presets import preset_config


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", nargs="+", type=int, default=[100, 200])
    p.add_argument("--json", default="bench_quant_stats.json")
    args = p.parse_args()
    cfg, device = preset_config("gpu"), torch.device("cuda")
    model = build_model(cfg, "nvfp4", device)
    opt, _ = make_optimizer(model, cfg)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device)
    stats = QuantStats(model, every=1)

    def step(cache=True):
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=cache):
            loss = lm_loss(model, x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def recorded():
        with stats.step(0):
            step()

    ms = {"eager": median_ms(step), "recorded": median_ms(recorded)}
    ms["graph"] = median_ms(cuda_graph(lambda: step(cache=False)))
    cost = {n: (ms["recorded"] - ms["graph"]) / n / ms["graph"] for n in args.every}
    write_json(args.json, {**environment(), "ms": ms, "cost_per_step": cost})
    print("| step | ms |\n| --- | --- |")
    for name, v in ms.items():
        print(f"| {name} | {v:.2f} |")
    for n, c in cost.items():
        print(f"every {n} steps: {100 * c:.2f}% of a graph step")


if __name__ == "__main__":
    main()

"""What ``--quant-stats-every N`` (``inspect.QuantStats``) costs on the GPU preset model: a step
that records the statistics quantizes its operands once more and computes their statistics. The
main job replays it from a second CUDA graph (``QuantStats.graphed``); an eager loop records
eagerly. Reports the graph step, the recorded graph step, the eager step and the recorded eager
step, and the cost per step at every N steps as a share of a step in the same mode, all from
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
        return loss.detach()

    def recorded(cache=True):
        with stats.step(0):
            step(cache)

    ms = {"eager": median_ms(step), "recorded, eager": median_ms(recorded)}
    graph_step = lambda: step(cache=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up as capture requires, the recording's kernels included
        recorded(cache=False)
    torch.cuda.current_stream().wait_stream(side)
    replay = cuda_graph(graph_step)
    record = stats.graphed(graph_step)
    ms["graph"] = median_ms(replay)
    ms["recorded, graph"] = median_ms(lambda: record(0))
    cost = {f"{mode}, every {n}": (ms[f"recorded, {mode}"] - ms[mode]) / n / ms[mode]
            for mode in ("graph", "eager") for n in args.every}
    write_json(args.json, {**environment(), "ms": ms, "cost_per_step": cost})
    print("| step | ms |\n| --- | --- |")
    for name, v in ms.items():
        print(f"| {name} | {v:.2f} |")
    for what, c in cost.items():
        print(f"recording {what} steps: {100 * c:.2f}% of a {what.split(',')[0]} step")


if __name__ == "__main__":
    main()

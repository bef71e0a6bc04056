"""FSDP2 training of a wide transformer under bf16 and NVFP4: step time, tokens/s and peak memory per
GPU, and the loss after the last step.

The model is the main job's TinyLM made wide (d_model 2048, d_ff 8192, 4 blocks, 16 heads, sequences
of 1024 bytes; 204M parameters), each block and the root wrapped with ``fully_shard`` (bf16
parameters, fp32 gradient reduction), trained with AdamW on the main job's corpus (Python sources),
every rank on its own sequences. NVFP4 is ``quantize_`` with the default recipe (lm_head kept in
high precision, as in the main job) and independent SR streams per rank (``set_sr_rank``). Step
time is the median over the steps after the first five (wall clock, synchronized); tokens/s and
peak memory (``torch.cuda.max_memory_allocated``) are per GPU, rank 0's; the loss is the mean over
the ranks and the last five steps. Prints a table and writes JSON (rank 0).

``--sr-draws D`` trains NVFP4 D times from the same initialization and data with other SR streams
(draw d gives rank r the stream ``sr_rank = r + d * world``, so no two draws or ranks share one):
the spread of their losses is the SR noise that a run on another number of GPUs (the same global
batch, other streams) must stay within.

    torchrun --nproc-per-node N benchmarks/bench_distributed.py [--steps 50] [--json out.json]
    torchrun --nproc-per-node 1 benchmarks/bench_distributed.py --batch-per-gpu 16 --sr-draws 4
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny   # a CPU check
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import environment, markdown_table, write_json
from nvfp4_recipe.distributed import set_sr_rank
from nvfp4_recipe.linear import NVFP4Linear
from nvfp4_recipe.moe import NVFP4Experts
from nvfp4_recipe.train.config import ModelConfig, TrainConfig
from nvfp4_recipe.train.data import Batches, load_corpus
from nvfp4_recipe.train.loop import lm_loss, make_optimizer
from nvfp4_recipe.train.model import TinyLM, count_params
from nvfp4_recipe.train.recipes import apply_recipe

WIDE = ModelConfig(d_model=2048, n_layers=4, n_heads=16, d_ff=8192, seq_len=1024)
TINY = ModelConfig(d_model=64, n_layers=1, n_heads=2, d_ff=256, seq_len=64)
WARMUP = 5  # steps left out of the step time


def setup(device_name: str) -> torch.device:
    """The process group (NCCL on GPUs, gloo on the CPU; one process without torchrun) and this
    rank's device."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if device_name == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_name)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def build(recipe: str, cfg: ModelConfig, device: torch.device, draw: int = 0) -> torch.nn.Module:
    """The model (the same initialization on every rank), quantized under ``recipe`` with SR
    streams ``rank + draw * world``, with each block and the root sharded by fully_shard (bf16
    parameters, fp32 reduction) on ``device``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = apply_recipe(TinyLM(cfg), recipe, seed=0, backend="auto")
    if recipe != "bf16":
        set_sr_rank(model)
        for layer in model.modules():
            if isinstance(layer, (NVFP4Linear, NVFP4Experts)):
                layer.sr_rank += draw * dist.get_world_size()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(recipe: str, cfg: ModelConfig, batches: Batches, steps: int, device: torch.device,
            draw: int = 0) -> dict:
    """Train ``steps`` steps; rank 0's step time, tokens/s and peak memory, and the mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(recipe, cfg, device, draw)
    opt, _ = make_optimizer(model, TrainConfig(lr=3e-4))
    batches.generator.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        x, y = batches.train_batch(device)
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        _sync(device)
        start = time.perf_counter()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    ms = 1e3 * statistics.median(times[WARMUP:] or times)
    return {"step_ms": ms, "tokens_per_s_per_gpu": x.numel() / ms * 1e3,
            "peak_gib_per_gpu": (torch.cuda.max_memory_allocated(device) / 2**30
                                 if device.type == "cuda" else None),
            "loss": statistics.mean(losses[-5:]), "params": count_params(model)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-per-gpu", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--device", default="cuda", help="cuda (one GPU per process) or cpu (gloo)")
    p.add_argument("--sr-draws", type=int, default=1,
                   help="NVFP4 runs with independent SR streams (their loss spread is the SR noise)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and 6 steps, to check the script")
    p.add_argument("--json", default="bench_distributed.json")
    args = p.parse_args()
    device = setup(args.device)
    cfg, steps = (TINY, min(args.steps, 6)) if args.tiny else (WIDE, args.steps)
    world = dist.get_world_size()
    corpus = load_corpus(max_bytes=int(2e6 if args.tiny else 64e6))
    batches = Batches(corpus, args.batch_per_gpu * world, cfg.seq_len, seed=0)
    results = {"bf16": measure("bf16", cfg, batches, steps, device)}
    for draw in range(args.sr_draws):
        name = "nvfp4" if draw == 0 else f"nvfp4 (SR draw {draw})"
        results[name] = measure("nvfp4", cfg, batches, steps, device, draw)
    if dist.get_rank() == 0:
        rows = [{"recipe": r, **v, "x bf16 step": v["step_ms"] / results["bf16"]["step_ms"],
                 "loss": f"{v['loss']:.5f}"}
                for r, v in results.items()]
        draws = [v["loss"] for r, v in results.items() if r.startswith("nvfp4")]
        if len(draws) > 1:
            print(f"NVFP4 loss over {len(draws)} SR draws: mean {statistics.mean(draws):.5f}, "
                  f"standard deviation {statistics.stdev(draws):.5f}")
        print(f"FSDP2, {world} x {device.type}, {vars(cfg)}, {steps} steps, "
              f"{args.batch_per_gpu} x {cfg.seq_len} tokens per GPU per step")
        print(markdown_table(rows, ["recipe", "step_ms", "x bf16 step", "tokens_per_s_per_gpu",
                                    "peak_gib_per_gpu", "loss"]))
        write_json(args.json, {"environment": environment(), "world_size": world,
                               "model": vars(cfg), "steps": steps,
                               "batch_per_gpu": args.batch_per_gpu, "sr_draws": args.sr_draws,
                               "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""FSDP2 training of a wide transformer: bf16, NVFP4, NVFP4 with the fp4 weight all-gather.

Eager and compiled: step time, tokens/s, peak memory and bytes all-gathered per GPU per step.

The model is the main job's TinyLM made wide (d_model 2048, d_ff 8192, 4 blocks, 16 heads, sequences
of 1024 bytes; 204M parameters), each block and the root wrapped with ``fully_shard`` (bf16
parameters, fp32 gradient reduction), trained with AdamW on the main job's corpus (Python sources),
every rank on its own sequences (16 x 1024 tokens per GPU by default, whatever the world size).
NVFP4 is ``quantize_`` with the default recipe (lm_head kept in high precision, as in the main
job) and independent SR streams per rank (``set_sr_rank``); "nvfp4" gathers the bf16 weights and
quantizes them on every rank, "nvfp4 fp4-gather" quantizes each rank's shard and gathers codes and
scales (``nvfp4_recipe.fsdp.enable_fp4_all_gather``). "compiled" compiles each transformer block
(``blocks.repeated_blocks``, ``block.compile()`` before ``fully_shard``, as torchtitan does).
Step time is the median over the steps after the first five (wall clock, synchronized), its ratio
to bf16's in the same mode and run; tokens/s and peak memory (``torch.cuda.max_memory_allocated``)
are per GPU, rank 0's; gathered MiB are those of FSDP2's all-gather outputs on rank 0 (every
parameter, the rank's own shard included) per step; the loss is the mean over the ranks and the
last five steps. Prints a table and writes JSON (rank 0).

``--sr-draws D`` trains eager NVFP4 D times from the same initialization and data with other SR
streams (draw d gives rank r the stream ``sr_rank = r + d * world``, so no two draws or ranks share
one): the spread of their losses is the SR noise that a run on another number of GPUs (the same
global batch, other streams) must stay within.

    torchrun --nproc-per-node N benchmarks/bench_distributed.py [--steps 50] [--json out.json]
    torchrun --nproc-per-node 1 benchmarks/bench_distributed.py --sr-draws 3 --modes eager
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny --modes eager
"""

import argparse
import gc
import os
import statistics
import time
from typing import List

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from common import environment, markdown_table, write_json
from nvfp4_recipe.blocks import repeated_blocks
from nvfp4_recipe.distributed import set_sr_rank
from nvfp4_recipe.fsdp import enable_fp4_all_gather
from nvfp4_recipe.linear import NVFP4Linear
from nvfp4_recipe.moe import NVFP4Experts
from nvfp4_recipe.train.config import ModelConfig, TrainConfig
from nvfp4_recipe.train.data import Batches, load_corpus
from nvfp4_recipe.train.loop import lm_loss, make_optimizer
from nvfp4_recipe.train.model import TinyLM, count_params
from nvfp4_recipe.train.recipes import apply_recipe

WIDE = ModelConfig(d_model=2048, n_layers=4, n_heads=16, d_ff=8192, seq_len=1024)
TINY = ModelConfig(d_model=64, n_layers=1, n_heads=2, d_ff=256, seq_len=64)
WARMUP = 5  # steps left out of the step time (compilation happens in the first ones)
# name -> (recipe, fp4 all-gather)
CONFIGS = {"bf16": ("bf16", False), "nvfp4": ("nvfp4", False), "nvfp4 fp4-gather": ("nvfp4", True)}
MODES = ("eager", "compiled")


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


class GatherCounter:
    """Counts the bytes of FSDP2's all-gather outputs in this process: wraps FSDP2's private
    ``foreach_all_gather`` (torch 2.11 and 2.13 both call it from ``_fsdp_param_group``) for as
    long as the counter lives in a ``with`` block."""

    def __init__(self):
        self.bytes = 0
        self._inner = _fsdp_param_group.foreach_all_gather

    def __call__(self, *args, **kwargs):
        result = self._inner(*args, **kwargs)
        if result is not None:
            out = result.all_gather_output
            self.bytes += out.numel() * out.element_size()
        return result

    def __enter__(self):
        _fsdp_param_group.foreach_all_gather = self
        return self

    def __exit__(self, *exc):
        _fsdp_param_group.foreach_all_gather = self._inner


def build(recipe: str, fp4_gather: bool, compiled: bool, cfg: ModelConfig, device: torch.device,
          draw: int = 0) -> torch.nn.Module:
    """The model (the same initialization on every rank), quantized under ``recipe`` with SR
    streams ``rank + draw * world`` (and the fp4 all-gather), each block compiled if ``compiled``,
    each block and the root sharded by fully_shard (bf16 parameters, fp32 reduction) on
    ``device``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = apply_recipe(TinyLM(cfg), recipe, seed=0, backend="auto")
    if recipe != "bf16":
        set_sr_rank(model)
        for layer in model.modules():
            if isinstance(layer, (NVFP4Linear, NVFP4Experts)):
                layer.sr_rank += draw * dist.get_world_size()
    if fp4_gather:
        enable_fp4_all_gather(model)
    if compiled:
        for _, block in repeated_blocks(model):
            block.compile()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Drop the previous run's model and compiled graphs before measuring the next one's memory."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(config: str, mode: str, cfg: ModelConfig, batches: Batches, steps: int,
            device: torch.device, draw: int = 0) -> dict:
    """Train ``steps`` steps of ``config`` in ``mode``; rank 0's step time, tokens/s, peak memory
    and gathered bytes per step, and the mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _free(device)
    recipe, fp4_gather = CONFIGS[config]
    model = build(recipe, fp4_gather, mode == "compiled", cfg, device, draw)
    opt, _ = make_optimizer(model, TrainConfig(lr=3e-4))
    batches.generator.manual_seed(0)
    times: List[float] = []
    gathered: List[int] = []
    losses: List[float] = []
    for _ in range(steps):
        x, y = batches.train_batch(device)
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        _sync(device)
        start = time.perf_counter()
        with GatherCounter() as counter:
            loss = lm_loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
        times.append(time.perf_counter() - start)
        gathered.append(counter.bytes)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    ms = 1e3 * statistics.median(times[WARMUP:] or times)
    return {"step_ms": ms, "tokens_per_s_per_gpu": x.numel() / ms * 1e3,
            "peak_gib_per_gpu": (torch.cuda.max_memory_allocated(device) / 2**30
                                 if device.type == "cuda" else None),
            "gathered_mib_per_step": gathered[-1] / 2**20,
            "loss": statistics.mean(losses[-5:]), "params": count_params(model)}


def run_all(modes, sr_draws: int, cfg: ModelConfig, batches: Batches, steps: int,
            device: torch.device) -> dict:
    """{(config, mode) name: measure(...)} for every config in every mode, and the extra SR draws
    of eager NVFP4."""
    results = {}
    for mode in modes:
        for config in CONFIGS:
            results[f"{config} {mode}"] = measure(config, mode, cfg, batches, steps, device)
    if "eager" in modes:
        for draw in range(1, sr_draws):
            results[f"nvfp4 eager (SR draw {draw})"] = measure("nvfp4", "eager", cfg, batches,
                                                               steps, device, draw)
    return results


def report(results: dict, modes, args, cfg: ModelConfig, steps: int, world: int,
           device: torch.device) -> None:
    """Rank 0: the table (ratios to bf16 in the same mode), the SR spread, the JSON file."""
    rows = []
    for name, v in results.items():
        bf16 = results[f"bf16 {next(m for m in modes if m in name)}"]
        rows.append({"run": name, **v, "x bf16 step": v["step_ms"] / bf16["step_ms"],
                     "x bf16 gathered": v["gathered_mib_per_step"] / bf16["gathered_mib_per_step"],
                     "loss": f"{v['loss']:.5f}"})
    draws = [v["loss"] for name, v in results.items() if name.startswith("nvfp4 eager")]
    if len(draws) > 1:
        print(f"NVFP4 loss over {len(draws)} SR draws: mean {statistics.mean(draws):.5f}, "
              f"standard deviation {statistics.stdev(draws):.5f}")
    print(f"FSDP2, {world} x {device.type}, {vars(cfg)}, {steps} steps, "
          f"{args.batch_per_gpu} x {cfg.seq_len} tokens per GPU per step")
    print(markdown_table(rows, ["run", "step_ms", "x bf16 step", "tokens_per_s_per_gpu",
                                "peak_gib_per_gpu", "gathered_mib_per_step", "x bf16 gathered",
                                "loss"]))
    write_json(args.json, {"environment": environment(), "world_size": world,
                           "model": vars(cfg), "steps": steps, "modes": list(modes),
                           "batch_per_gpu": args.batch_per_gpu, "sr_draws": args.sr_draws,
                           "results": results})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-per-gpu", type=int, default=16, help="sequences per GPU per step")
    p.add_argument("--device", default="cuda", help="cuda (one GPU per process) or cpu (gloo)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="eager, and/or compiled (each transformer block compiled)")
    p.add_argument("--sr-draws", type=int, default=1,
                   help="eager NVFP4 runs with independent SR streams (their loss spread is the SR noise)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and 6 steps, to check the script")
    p.add_argument("--json", default="bench_distributed.json")
    return p.parse_args(argv)


def main():
    args = parse_args()
    device = setup(args.device)
    cfg, steps = (TINY, min(args.steps, 6)) if args.tiny else (WIDE, args.steps)
    world = dist.get_world_size()
    corpus = load_corpus(max_bytes=int(2e6 if args.tiny else 64e6))
    batches = Batches(corpus, args.batch_per_gpu * world, cfg.seq_len, seed=0)
    results = run_all(args.modes, args.sr_draws, cfg, batches, steps, device)
    if dist.get_rank() == 0:
        report(results, args.modes, args, cfg, steps, world, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""LoRA on a frozen NVFP4 base against LoRA on a frozen bf16 base, one GPU: step time and memory.

For each (tokens, in, out) shape, one linear layer with a PEFT LoRA adapter (rank --rank) on it, the
input requiring grad (as inside a model, so dgrad runs); a step is forward + backward of
``y.backward(dy)``. Bases:

- ``bf16``: a frozen bf16 nn.Linear (the usual LoRA);
- ``nvfp4``: ``frozen.NVFP4FrozenLinear`` running fprop and dgrad as NVFP4 GEMMs (the Triton
  backend on Hopper: the recipe's X and dY quantization);
- ``nvfp4-bf16gemm``: the same frozen base, the GEMMs in bf16 on the weight dequantized per call.

Reported: the step time over bf16's (median, ``common.median_ms``), the bytes of the frozen base
(codes + E4M3 scales + outer scale; bf16: the weight) per parameter, and the peak memory of a step.
Prints a markdown table and writes JSON.

    python benchmarks/bench_lora.py [--json lora.json] [--shapes 16384x4096x4096 ...] [--rank 16]
"""

import argparse

import torch
from peft import get_peft_model
from torch import nn

from common import environment, markdown_table, median_ms, write_json
from nvfp4_recipe import NVFP4Linear, NVFP4Recipe
from nvfp4_recipe.frozen import NVFP4FrozenLinear, lora_config
from nvfp4_recipe.serving import fprop_weight_1x16

SHAPES = ["16384x4096x4096", "16384x4096x14336", "16384x14336x4096"]
BASES = ("bf16", "nvfp4", "nvfp4-bf16gemm")


def base_layer(kind: str, k: int, n: int, device) -> nn.Module:
    """A frozen (n, k) linear of kind ``kind`` with a random weight (std 0.02)."""
    linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    nn.init.normal_(linear.weight, std=0.02)
    if kind == "bf16":
        return linear.requires_grad_(False)
    op, _ = fprop_weight_1x16(NVFP4Linear.from_module(linear, NVFP4Recipe()))
    gemm = "bf16" if kind == "nvfp4-bf16gemm" else "nvfp4"
    return NVFP4FrozenLinear(op.qdata, op.scale, op.outer_scale, dtype=torch.bfloat16, gemm=gemm)


def base_bytes(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()]
               if t.dim() >= 1 and t.numel() >= 256)  # the weight's tensors, not signs or seeds


def lora_model(kind: str, k: int, n: int, rank: int, device):
    """(model, base bytes): a LayerNorm (PEFT wants a parameter in the model) and the base layer
    with a LoRA adapter of rank ``rank`` on it."""
    base = base_layer(kind, k, n, device)
    model = nn.Sequential(nn.LayerNorm(k, device=device, dtype=torch.bfloat16), base)
    model = get_peft_model(model, lora_config(r=rank, target_modules=["1"], lora_alpha=2 * rank))
    return model.to(torch.bfloat16), base_bytes(base)


def measure(kind: str, m: int, k: int, n: int, rank: int, device) -> dict:
    model, nbytes = lora_model(kind, k, n, rank, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step():
        x.grad = None
        model(x).backward(dy)

    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    peak = torch.cuda.max_memory_allocated(device)
    return {"base": kind, "ms": median_ms(step), "base_bytes": nbytes,
            "bytes_per_param": nbytes / (k * n), "peak_gib": peak / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="MxKxN: tokens x in x out")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", default="bench_lora.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        m, k, n = map(int, shape.split("x"))
        results = [measure(kind, m, k, n, args.rank, device) for kind in BASES]
        for r in results:
            rows.append({"shape": shape, **r, "time_vs_bf16": r["ms"] / results[0]["ms"],
                         "memory_vs_bf16": r["base_bytes"] / results[0]["base_bytes"]})
        torch.cuda.empty_cache()
    print(markdown_table(rows, ["shape", "base", "ms", "time_vs_bf16", "bytes_per_param",
                                "memory_vs_bf16", "peak_gib"]))
    write_json(args.json, {"env": environment(), "rank": args.rank, "rows": rows})


if __name__ == "__main__":
    main()

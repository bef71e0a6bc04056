"""The ``nvfp4-recipe`` command (also ``python -m nvfp4_recipe``): its arguments, and ``main``.

``nvfp4-recipe train`` trains one small byte-level transformer on Python source files under several
recipes (bf16 and NVFP4 variants) and compares them; the run is ``train/job.py``. This module does
not import torch, so that ``--help`` and ``--version`` answer at once.
"""

import argparse
import sys
from typing import Optional, Sequence

from .spec import BackendName, enum_values
from .train.config import (DESCRIPTIONS, EXIT_INTERRUPTED, EXIT_USAGE, MODES, MOE_EXPERTS, MOE_TOP_K,
                           PROG, RECIPES, SEED_LIMIT)
from .train.presets import PRESETS
from .version import package_version

DEFAULT_RECIPES = ("bf16", "nvfp4")


def _recipe_help() -> str:
    return "recipes:\n" + "\n".join(f"  {name:<18} {DESCRIPTIONS[name]}" for name in RECIPES)


def _preset_help() -> str:
    lines = ["presets (options given on the command line override them):"]
    for name, (cfg, data) in PRESETS.items():
        lines.append(f"  {name:<5} d_model={cfg.d_model} n_layers={cfg.n_layers} n_heads={cfg.n_heads} "
                     f"d_ff={cfg.d_ff} seq_len={cfg.seq_len} batch_size={cfg.batch_size} "
                     f"steps={cfg.steps} lr={cfg.lr} max_mb={data['max_mb']}")
    return "\n".join(lines)


def _seed(text: str) -> int:
    """argparse type of --seed: an int in [0, 2**31)."""
    digits = text.strip()
    if not (digits.isdecimal() and int(digits) < SEED_LIMIT):
        raise argparse.ArgumentTypeError(f"must be an int in [0, 2**31), got {text}")
    return int(digits)


def _add_preset_options(group, options) -> None:
    """Options whose default (None) means 'the preset's value'; ``options``: (flag, type, help)."""
    for flag, type_, help_ in options:
        group.add_argument(flag, type=type_, metavar="N" if type_ is int else "X",
                           help=f"{help_} (default: the preset's)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nvfp4-recipe`` (subcommand ``train``)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="NVFP4 training for PyTorch: the main job and tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "train", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="train one model under bf16 and NVFP4 recipes and compare the losses",
        description=(
            "Train the same small byte-level transformer (RMSNorm, causal SDPA attention, GELU MLP)\n"
            "under each recipe with the same initialization, data order and seed, on the Python\n"
            "source files of this interpreter's standard library (plus --data DIRs), split into\n"
            "train/validation by file. NVFP4 recipes call quantize_(model, NVFP4Recipe(...)) and keep\n"
            "the embedding and the output projection (lm_head) in high precision.\n"
            "Prints a table (final train loss, validation loss in nats per byte, relative gap to bf16,\n"
            "tokens/s, peak memory) and writes results.json and loss_curves.png to --out."),
        epilog=_recipe_help() + "\n\n" + _preset_help())
    add = p.add_argument
    add("--recipes", nargs="+", metavar="NAME", default=list(DEFAULT_RECIPES),
        help=f"recipes to train, in order (default: {' '.join(DEFAULT_RECIPES)}); see the list below")
    add("--preset", choices=list(PRESETS), default="cpu",
        help="model/run size (default: cpu, about 3 minutes on 2 idle CPU cores); see below")
    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", metavar="DIR", default=[],
                      help="more directories whose *.py files join the corpus (e.g. site-packages)")
    data.add_argument("--no-stdlib", action="store_true",
                      help="leave the standard library out (then --data is required)")
    data.add_argument("--max-mb", type=float, metavar="MB",
                      help="read a seeded random subset of the files of at most about MB megabytes "
                           "(default: the preset's; 0 = no cap)")
    data.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                      help="share of the bytes, by whole files, held out for validation (default 0.05)")
    model = p.add_argument_group("model (dims must be multiples of 16)")
    _add_preset_options(model, (
        ("--d-model", int, "width of the residual stream"), ("--n-layers", int, "transformer blocks"),
        ("--n-heads", int, "attention heads; --d-model must be a multiple of it"),
        ("--d-ff", int, "hidden width of the MLP (of each expert with --moe)"),
        ("--seq-len", int, "tokens (bytes) per sequence")))
    model.add_argument("--moe", action="store_true",
                       help=f"mixture-of-experts feed-forward layers: {MOE_EXPERTS} SwiGLU experts, "
                            f"top-{MOE_TOP_K} routing (NVFP4 recipes run the experts as grouped "
                            f"NVFP4 GEMMs and keep the router in high precision)")
    model.add_argument("--experts", type=int, metavar="N",
                       help=f"experts per MoE layer (implies --moe; default {MOE_EXPERTS})")
    model.add_argument("--top-k", type=int, metavar="K",
                       help=f"experts per token (implies --moe; default {MOE_TOP_K})")
    opt = p.add_argument_group("optimization")
    _add_preset_options(opt, (
        ("--steps", int, "optimizer steps per recipe"), ("--batch-size", int, "sequences per step"),
        ("--lr", float, "peak AdamW learning rate (warm-up, then cosine decay to a tenth)"),
        ("--warmup-steps", int, "linear learning-rate warm-up steps"),
        ("--eval-every", int, "steps between validation passes"),
        ("--eval-tokens", int, "validation tokens per pass")))
    opt.add_argument("--seed", type=_seed, default=0, metavar="N",
                     help="seeds the file split (unless --split-seed), the initialization, the data "
                          "order and NVFP4Recipe.seed")
    opt.add_argument("--split-seed", type=_seed, default=None, metavar="N",
                     help="seeds the train/validation file split instead of --seed, so that runs "
                          "with different --seed share one split (a --seeds study spread over "
                          "several commands or GPUs)")
    opt.add_argument("--seeds", type=int, default=1, metavar="N",
                     help="train each recipe N times, with seeds --seed, --seed + 1, ... (the file "
                          "split stays --seed's); the table adds the mean and standard deviation of "
                          "each recipe's validation loss and gap (default 1)")
    run = p.add_argument_group("execution and output")
    run.add_argument("--workers", type=int, default=1, metavar="N",
                     help="spread the runs over N processes, one GPU each (cuda:0 ... cuda:N-1; on "
                          "the CPU they share the cores), and report them in one table: a study "
                          "of several recipes and seeds on a node in one command (default 1)")
    run.add_argument("--device", default="auto",
                     help="torch device; auto = cuda if available, else cpu (default auto)")
    run.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                     help="dtype of everything NVFP4 does not quantize, in every recipe (bf16 = autocast "
                          "with fp32 master weights); auto = bf16 on CUDA and on CPUs with native bf16 "
                          "matmul (AMX / AVX512-BF16), else fp32. The baseline recipe keeps the name bf16 "
                          "and the table says which precision it ran in")
    run.add_argument("--backend", choices=enum_values(BackendName), default=BackendName.AUTO.value,
                     help="NVFP4Recipe.backend (auto: native on Blackwell, triton on other GPUs, "
                          "reference on CPU)")
    run.add_argument("--mode", choices=("auto", *MODES), default="auto",
                     help="how steps run: eager (the plain loop), graph (the whole step captured "
                          "in one CUDA graph and replayed: the same numbers without the host's kernel "
                          "launch cost) or compile (each transformer block compiled with "
                          "torch.compile, as torchtitan does: Inductor fuses the bf16 arithmetic "
                          "around the NVFP4 layers, so the losses match eager's to rounding, not bit "
                          "for bit); auto = graph on CUDA in one process, compile on CUDA under "
                          "torchrun, eager elsewhere (default auto)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="CPU threads of torch (torch.set_num_threads; default: the CPUs not busy, "
                          "those of this process less the 1-minute load average, at least 1 and at "
                          "most torch's choice)")
    run.add_argument("--out", metavar="DIR",
                     help="output directory (default: runs/<timestamp>/); one that already holds a "
                          "results.json is refused unless --overwrite is given")
    run.add_argument("--overwrite", action="store_true",
                     help="write into an --out that already holds results of an earlier run, "
                          "replacing them")
    run.add_argument("--export", metavar="DIR",
                     help="write each NVFP4 recipe's trained model to DIR/<recipe>/ (DIR/<recipe>-seed<N>/ "
                          "with --seeds) as an NVFP4 checkpoint (compressed-tensors layout, "
                          "docs/serving.md); DIR must not exist or be empty and be writable, and "
                          "every NVFP4 recipe must leave a linear in NVFP4 with per-tensor scales "
                          "(checked before training). A failed export is reported, the run's "
                          "results kept, and the exit status is 1")
    run.add_argument("--quant-stats-every", type=int, default=0, metavar="N",
                     help="record NVFP4 quantization statistics of every layer's operands every N "
                          "steps (inspect.QuantStats: flushed to zero, saturated, relative MSE, zero "
                          "and subnormal block scales, blocks mapped to 4) into results.json and "
                          "quant_stats.png; in graph mode a recorded step replays a second CUDA graph (a model "
                          "with experts records eagerly) (default 0: off)")
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nvfp4-recipe`` console script. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    from .train import job  # imports torch: here, so that --help and --version do not
    try:
        return job.train_command(args, argv)
    except job.UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before any run started
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""The ``nvfp4-recipe`` command (also ``python -m nvfp4_recipe``).

``nvfp4-recipe train`` trains one small byte-level transformer on Python source files under several
recipes (bf16 and NVFP4 variants) with the same initialization, data order and seed, then prints a
table and writes ``results.json`` and ``loss_curves.png`` to ``--out``. Launched by torchrun on
several processes it trains data-parallel (``train/parallel.py``); rank 0 reports.
"""

import argparse
import datetime
import importlib.metadata
import math
import os
import platform
import sys
import tempfile
import time
from typing import Optional, Sequence

import torch

from .backends import get_backend
from .spec import BackendName, enum_values
from .train import data as D
from .train.loop import train_run
from .train.model import TinyLM, count_params
from .train.parallel import DataParallel
from .train.presets import PRESETS, preset_config
from .train.recipes import DESCRIPTIONS, RECIPES, check_recipes, make_recipe
from .train.report import format_table, plot_curves, write_json

PROG = "nvfp4-recipe"
DEFAULT_RECIPES = ("bf16", "nvfp4")
MOE_EXPERTS, MOE_TOP_K = 8, 2
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
SEED_LIMIT = 2**31  # NVFP4Recipe.seed's range is [0, 2**31)


class UsageError(Exception):
    """A bad argument: reported as one line 'nvfp4-recipe train: error: ...' with exit status 2."""


def _recipe_help() -> str:
    return "recipes:\n" + "\n".join(f"  {name:<18} {DESCRIPTIONS[name]}" for name in RECIPES)


def _preset_help() -> str:
    lines = ["presets (options given on the command line override them):"]
    for name, (cfg, data) in PRESETS.items():
        lines.append(f"  {name:<5} d_model={cfg.d_model} n_layers={cfg.n_layers} n_heads={cfg.n_heads} "
                     f"d_ff={cfg.d_ff} seq_len={cfg.seq_len} batch_size={cfg.batch_size} "
                     f"steps={cfg.steps} lr={cfg.lr} max_mb={data['max_mb']}")
    return "\n".join(lines)


def _version() -> str:
    try:
        return importlib.metadata.version("nvfp4-recipe")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


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
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
                     help="seeds the file split, the initialization, the data order and NVFP4Recipe.seed")
    run = p.add_argument_group("execution and output")
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
    run.add_argument("--mode", choices=("auto", "eager", "graph"), default="auto",
                     help="how steps run: eager (the plain loop) or graph (the whole step captured "
                          "in one CUDA graph and replayed: the same numbers without the host's kernel "
                          "launch cost); auto = graph on CUDA for a dense model, eager elsewhere "
                          "(default auto)")
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
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return parser


def _config_from_args(args):
    """(TrainConfig, max_bytes) from the preset and the options; raises ValueError when invalid."""
    cfg = preset_config(args.preset, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                        d_ff=args.d_ff, seq_len=args.seq_len, steps=args.steps,
                        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                        eval_every=args.eval_every, eval_tokens=args.eval_tokens, seed=args.seed,
                        backend=args.backend, mode=args.mode, **_moe_fields(args))
    cfg.validate()
    if args.max_mb is not None and not 0 <= args.max_mb < math.inf:
        raise ValueError(f"--max-mb must be a finite number >= 0, got {args.max_mb}")
    max_mb = PRESETS[args.preset][1]["max_mb"] if args.max_mb is None else (args.max_mb or None)
    return cfg, None if max_mb is None else int(max_mb * 1e6)


def _moe_fields(args) -> dict:
    """n_experts and top_k of the run: 0 experts (dense) unless --moe, --experts or --top-k.

    Raises:
        ValueError: --experts below 1 (an MoE run needs experts; leave the MoE options out for a
            dense model).
    """
    if not (args.moe or args.experts is not None or args.top_k is not None):
        return {}
    if args.experts is not None and args.experts < 1:
        raise ValueError(f"--experts must be >= 1 (leave out --moe, --experts and --top-k for a "
                         f"dense model), got {args.experts}")
    return {"n_experts": MOE_EXPERTS if args.experts is None else args.experts,
            "top_k": MOE_TOP_K if args.top_k is None else args.top_k}


def idle_threads(most: int) -> int:
    """The CPUs this process may use less the 1-minute load average, rounded, in [1, most].

    Threads that share a core with another busy process slow the many small ops of the reference
    NVFP4 path tenfold (each op waits for its slowest thread); one thread per idle core does not.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(most, round(cpus - busy)))


def _device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def _cpu_has_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AMX / AVX512-BF16); False if unknown."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private op: absent from some builds
        return False


def _precision(name: str, device):
    """(autocast dtype or None, label) for --precision on ``device``."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" or (device.type == "cpu" and _cpu_has_bf16()) else "fp32"
    if name == "bf16":
        return torch.bfloat16, "bf16 autocast, fp32 master weights and optimizer"
    return None, "fp32 (no autocast)"


def _hardware(device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _write_outputs(out: str, meta: dict, results, final: bool) -> Optional[str]:
    """Write results.json (always) and, when ``final``, loss_curves.png; returns the plot's path, or
    None when there is none (no finished run, or matplotlib missing: said on stderr)."""
    write_json(os.path.join(out, "results.json"), meta, results)
    if not (final and results):
        return None
    try:
        import matplotlib  # noqa: F401  (an optional dependency: the [plot] extra)
    except ImportError:
        print(f"{PROG}: no plot: matplotlib is not installed (pip install 'nvfp4-recipe[plot]')",
              file=sys.stderr)
        return None
    cfg = meta["config"]
    title = (f"{meta['params'] / 1e6:.1f}M-param byte-level LM, {cfg['steps']} steps x "
             f"{cfg['batch_size'] * cfg['seq_len']} tokens, {meta['hardware']}, {meta['precision']}")
    path = os.path.join(out, "loss_curves.png")
    plot_curves(path, results, title)
    return path


def _check_out(out: str, overwrite: bool) -> None:
    """Create the output directory and make sure a file can be written there.

    Raises:
        ValueError: ``out`` is a file, cannot be created or written, or holds an earlier run's
            results.json and ``overwrite`` is False.
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out}: exists and is not a directory")
    if os.path.exists(os.path.join(out, "results.json")) and not overwrite:
        raise ValueError(f"--out {out}: already holds results.json of an earlier run; choose another "
                         f"--out or pass --overwrite to replace it")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there: {e.strerror or e}") from None


def _prepare(args):
    """Validate everything, cheapest first, then load the data, so that a bad argument fails
    before any slow work: (cfg, corpus, batches, device, dtype, precision label, out directory,
    DataParallel or None). Under torchrun the process group is set up here.

    Raises:
        ValueError, FileNotFoundError: a bad argument (the message is the one-line error).
    """
    check_recipes(args.recipes)
    cfg, max_bytes = _config_from_args(args)
    if not 0 < args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.no_stdlib and not args.data:
        raise ValueError("--no-stdlib needs --data DIR")
    for d in args.data:  # fail before anything slow
        if not os.path.isdir(d):
            raise ValueError(f"data directory not found: {d}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads or idle_threads(torch.get_num_threads()))
    device = _device(args.device)
    parallel = DataParallel.from_env(device)  # under torchrun: this rank's share and device
    if parallel is not None:
        parallel.check_batch(cfg.batch_size)
        device = parallel.device
    cfg.step_mode(device, parallel is not None)  # --mode graph needs CUDA and one process
    recipes = [make_recipe(name, cfg.seed, cfg.backend) for name in args.recipes]  # validates them
    if any(r is not None for r in recipes):
        get_backend(cfg.backend, device)  # raises for a backend that cannot run on the device
    dtype, precision = _precision(args.precision, device)
    out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if parallel is None or parallel.is_main:  # rank 0 writes (a failure there stops torchrun)
        _check_out(out, args.overwrite)
    corpus = D.load_corpus(args.data, not args.no_stdlib, args.val_fraction, cfg.seed, max_bytes)
    batches = D.Batches(corpus, cfg.batch_size, cfg.seq_len, cfg.seed)
    return cfg, corpus, batches, device, dtype, precision, out, parallel


def _meta(args, argv: Sequence[str], cfg, corpus, device, precision: str, processes: int) -> dict:
    """What results.json records about the run besides the runs themselves."""
    from dataclasses import asdict

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([PROG, *argv]), "preset": args.preset, "device": str(device),
            "hardware": _hardware(device), "processes": processes, "precision": precision,
            "torch": torch.__version__,
            "python": platform.python_version(), "config": asdict(cfg),
            "params": count_params(TinyLM(cfg.model_config())), "data": corpus.as_dict(),
            "recipes": {name: DESCRIPTIONS[name] for name in args.recipes},
            "notes": "losses are mean next-byte cross-entropy in nats; the embedding and lm_head stay in "
                     "high precision in every recipe; train loss = mean of the last tenth of the steps; "
                     "tokens/s (of all processes) leaves out evaluation and the first min(10, steps/5) "
                     "steps; with several processes each trains on its share of every batch (DDP)"}


def _print_header(cfg, corpus, meta: dict, recipes: Sequence[str]) -> None:
    print(corpus.summary())
    moe = f", {cfg.n_experts} experts, top-{cfg.top_k}" if cfg.n_experts else ""
    print(f"model: {meta['params'] / 1e6:.2f}M parameters (d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
          f"n_heads={cfg.n_heads}, d_ff={cfg.d_ff}, seq_len={cfg.seq_len}{moe}); embedding and lm_head "
          f"stay in high precision under NVFP4")
    procs = f" x {meta['processes']} processes (DDP)" if meta["processes"] > 1 else ""
    print(f"run: {cfg.steps} steps x {cfg.batch_size * cfg.seq_len} tokens on {meta['hardware']}{procs}; "
          f"precision: {meta['precision']}; recipes: {' '.join(recipes)}", flush=True)


def train_command(args, argv: Sequence[str]) -> int:
    """Run ``nvfp4-recipe train``; returns the exit status (0, or 130 when interrupted).

    Results are written after every finished run, so an interrupt (or a crash) keeps them. Under
    torchrun with several processes, each trains data-parallel and rank 0 reports.

    Raises:
        UsageError: a bad argument.
    """
    start = time.perf_counter()
    try:
        cfg, corpus, batches, device, dtype, precision, out, parallel = _prepare(args)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    try:
        if parallel is not None and not parallel.is_main:  # trains beside rank 0, silently
            for name in args.recipes:
                train_run(name, cfg, batches, device, dtype, progress=False, parallel=parallel)
            return 0
        return _train_and_report(args, argv, start, cfg, corpus, batches, device, dtype, precision,
                                 out, parallel)
    finally:
        if parallel is not None:
            parallel.close()


def _train_and_report(args, argv, start, cfg, corpus, batches, device, dtype, precision, out,
                      parallel) -> int:
    """The runs of :func:`train_command` with the header, the table and the outputs (rank 0)."""
    meta = _meta(args, argv, cfg, corpus, device, precision, 1 if parallel is None else parallel.world)
    _print_header(cfg, corpus, meta, args.recipes)
    results, status = [], 0
    try:
        for name in args.recipes:
            result = train_run(name, cfg, batches, device, dtype, progress=not args.no_progress,
                               parallel=parallel)
            results.append(result)
            print(f"{name}: {result.status}, {result.quantized}, val loss {result.val_loss:.4f} nats, "
                  f"{result.wall_s:.0f} s, {result.mode} steps", flush=True)
            _write_outputs(out, dict(meta, wall_s=time.perf_counter() - start), results, final=False)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
        meta["interrupted"] = f"during recipe {args.recipes[len(results)]!r}"
        print(f"\ninterrupted during {args.recipes[len(results)]!r}; keeping the {len(results)} "
              f"finished run(s)", file=sys.stderr)
    meta["wall_s"] = time.perf_counter() - start
    plot = _write_outputs(out, meta, results, final=True)
    if results:
        print("\n" + format_table(results))
    print(f"\ntotal wall time {meta['wall_s']:.0f} s; wrote {os.path.join(out, 'results.json')}"
          + (f" and {plot}" if plot else ""))
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nvfp4-recipe`` console script. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return train_command(args, argv)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before any run started
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

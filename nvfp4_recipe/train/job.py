"""The run of ``nvfp4-recipe train`` (its command line is ``nvfp4_recipe.cli``).

It trains one small byte-level transformer on Python source files under several recipes (bf16 and
NVFP4 variants) with the same initialization, data order and seed, then prints a table and writes
``results.json`` and ``loss_curves.png`` to ``--out``. Launched by torchrun on several processes it
trains data-parallel (``parallel.py``); rank 0 reports.
"""

import datetime
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from typing import List, Optional, Sequence

import torch

from ..backends import get_backend
from ..frozen import load_frozen
from ..serving import check_exportable, export, record_amaxes
from . import data as D
from .config import (BASELINE, DESCRIPTIONS, EXIT_EXPORT_FAILED, EXIT_INTERRUPTED, MOE_EXPERTS,
                     MOE_TOP_K, PROG, SEED_LIMIT, ModelConfig, check_recipes)
from .loop import evaluate, train_run
from .model import TinyLM, count_params
from .parallel import DataParallel
from .presets import PRESETS, preset_config
from .recipes import apply_recipe, make_recipe
from .report import (format_paired_table, format_seed_table, format_table, paired_differences,
                     plot_curves, plot_gaps, plot_quant_stats, write_json)


class UsageError(Exception):
    """A bad argument: reported as one line 'nvfp4-recipe train: error: ...' with exit status 2."""


def _config_from_args(args):
    """(TrainConfig, max_bytes) from the preset and the options; raises ValueError when invalid."""
    cfg = preset_config(args.preset, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                        d_ff=args.d_ff, seq_len=args.seq_len, steps=args.steps,
                        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                        eval_every=args.eval_every, eval_tokens=args.eval_tokens, seed=args.seed,
                        backend=args.backend, mode=args.mode,
                        quant_stats_every=args.quant_stats_every, **_moe_fields(args))
    cfg.validate()
    if not (1 <= args.seeds and args.seed + args.seeds <= SEED_LIMIT):
        raise ValueError(f"--seeds must be >= 1 with --seed + --seeds <= 2**31, got {args.seeds}")
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


def _write_outputs(out: str, meta: dict, results, final: bool) -> List[str]:
    """Write results.json (always) and, when ``final``, loss_curves.png, (with recorded
    quantization statistics) quant_stats.png and (with several seeds) gaps.png; returns the plots' paths (none without a finished
    run, or with matplotlib missing: said on stderr)."""
    write_json(os.path.join(out, "results.json"), meta, results)
    if not (final and results):
        return []
    try:
        import matplotlib  # noqa: F401  (an optional dependency: the [plot] extra)
    except ImportError:
        print(f"{PROG}: no plot: matplotlib is not installed (pip install 'nvfp4-recipe[plot]')",
              file=sys.stderr)
        return []
    cfg = meta["config"]
    title = (f"{_param_count(meta['params'])}-param byte-level LM, {cfg['steps']} steps x "
             f"{cfg['batch_size'] * cfg['seq_len']} tokens, {meta['hardware']}, {meta['precision']}")
    curves, stats, gaps = (os.path.join(out, name) for name in ("loss_curves.png", "quant_stats.png", "gaps.png"))
    plot_curves(curves, results, title)
    return [curves] + [p for p, plot in ((stats, plot_quant_stats), (gaps, plot_gaps)) if plot(p, results, title)]


def _param_count(n: int) -> str:
    """A parameter count as plots title it: "38.2M", or "26K" below a million (the tiny preset)."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


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
    _check_writable("--out", out)


def _check_export(directory: Optional[str], recipes: Sequence[str], cfg) -> None:
    """Check --export before any run: the directory, and that each NVFP4 recipe exports a layer.

    Raises:
        ValueError: ``directory`` is a file or a directory that is not empty, cannot be created
            or written; no recipe trains in NVFP4 (only the baseline); a recipe leaves no linear
            in NVFP4 on this model or trains per-token activation scales, which the serving
            layouts cannot hold (``serving.check_exportable``).
    """
    if directory is None:
        return
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise ValueError(f"--export {directory}: exists and is not an empty directory")
    exported = [name for name in recipes if make_recipe(name, cfg.seed, cfg.backend) is not None]
    if not exported:
        raise ValueError(f"--export {directory}: none of the recipes {' '.join(recipes)} trains in "
                         f"NVFP4 ({BASELINE} is the high-precision baseline); nothing to export")
    for name in exported:
        with torch.device("meta"):
            model = apply_recipe(TinyLM(cfg.model_config()), name, cfg.seed, cfg.backend, quiet=True)
        try:
            check_exportable(model)
        except ValueError as e:
            raise ValueError(f"--export {directory}: recipe {name}: {e}") from None
    _check_writable("--export", directory)


def _check_writable(option: str, directory: str) -> None:
    """Create ``directory`` if needed and write a temporary file there.

    Raises:
        ValueError: naming ``option``, where that fails.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(f"{option} {directory}: cannot write there: {e.strerror or e}") from None


# config.json's entry holding the TinyLM shape of an --export checkpoint (servers ignore it)
EXPORT_CONFIG_KEY = "nvfp4_recipe_tinylm"


def export_trained(model: torch.nn.Module, cfg, batches: D.Batches, device, dtype, path: str) -> str:
    """Write a trained NVFP4 TinyLM to ``path`` as a compressed-tensors NVFP4 checkpoint, its
    activation global scales from the amaxes one validation pass gives (``serving.record_amaxes``)."""
    with record_amaxes(model) as amaxes:
        evaluate(model, batches, cfg, device, dtype)
    return export(model, path, "compressed-tensors", input_amax=amaxes,
                  config={EXPORT_CONFIG_KEY: asdict(cfg.model_config())})


def load_exported(path: str, recipe, device) -> TinyLM:
    """The TinyLM of an :func:`export_trained` checkpoint with a frozen NVFP4 base
    (``frozen.load_frozen``) under ``recipe``: the trained model's logits, bit for bit."""
    with open(os.path.join(path, "config.json")) as f:
        shape = ModelConfig(**json.load(f)[EXPORT_CONFIG_KEY])
    with torch.device("meta"):
        model = TinyLM(shape)
    return load_frozen(model, path, recipe).to(device)


def _prepare(args):
    """Validate everything, cheapest first, then load the data, so that a bad argument fails
    before any slow work: (cfg, corpus, batches, device, dtype, precision label, out directory,
    DataParallel or None). Under torchrun the process group is set up here.

    Raises:
        ValueError, FileNotFoundError: a bad argument (the message is the one-line error).
    """
    check_recipes(args.recipes)
    cfg, max_bytes = _config_from_args(args)
    _check_export(args.export, args.recipes, cfg)
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
    _check_workers(args.workers, device, parallel is not None)
    recipes = [make_recipe(name, cfg.seed, cfg.backend) for name in args.recipes]  # validates them
    if any(r is not None for r in recipes):
        get_backend(cfg.backend, device)  # raises for a backend that cannot run on the device
    dtype, precision = _precision(args.precision, device)
    out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if parallel is None or parallel.is_main:  # rank 0 writes (a failure there stops torchrun)
        _check_out(out, args.overwrite)
    corpus, batches = _data(args, cfg, max_bytes)
    return cfg, corpus, batches, device, dtype, precision, out, parallel


def _check_workers(workers: int, device, data_parallel: bool) -> None:
    """Raises ValueError for a --workers count this run cannot have."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and data_parallel:
        raise ValueError("--workers spreads whole runs over processes; under torchrun each run is "
                         "already data parallel: use one or the other")
    if workers > 1 and device.type == "cuda" and device.index is not None:
        raise ValueError(f"--workers {workers} puts worker i on cuda:i; pass --device cuda, not {device}")
    if device.type == "cuda" and workers > torch.cuda.device_count():
        raise ValueError(f"--workers {workers}: one GPU a worker, and this machine has "
                         f"{torch.cuda.device_count()}")


def _data(args, cfg, max_bytes: Optional[int]):
    """(corpus, batches): the files split by ``--split-seed`` (else ``--seed``), batches seeded by
    ``cfg.seed`` (each run re-seeds them with its own)."""
    split_seed = cfg.seed if args.split_seed is None else args.split_seed
    corpus = D.load_corpus(args.data, not args.no_stdlib, args.val_fraction, split_seed, max_bytes)
    return corpus, D.Batches(corpus, cfg.batch_size, cfg.seq_len, cfg.seed)


def _meta(args, argv: Sequence[str], cfg, corpus, device, precision: str, processes: int) -> dict:
    """What results.json records about the run besides the runs themselves."""
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([PROG, *argv]), "preset": args.preset, "device": str(device),
            "hardware": _hardware(device), "processes": processes, "precision": precision,
            "torch": torch.__version__,
            "python": platform.python_version(), "config": asdict(cfg),
            "params": count_params(TinyLM(cfg.model_config())),
            "data": dict(corpus.as_dict(), split_seed=cfg.seed if args.split_seed is None else args.split_seed),
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
            for name, run_cfg in _runs(args, cfg):
                train_run(name, run_cfg, batches, device, dtype, progress=False, parallel=parallel)
            return 0
        return _train_and_report(args, argv, start, cfg, corpus, batches, device, dtype, precision,
                                 out, parallel)
    finally:
        if parallel is not None:
            parallel.close()


def _runs(args, cfg):
    """(recipe, its TrainConfig) of every run, seed by seed: --seeds N trains each recipe with
    seeds --seed, ..., --seed + N - 1."""
    return [(name, replace(cfg, seed=cfg.seed + i)) for i in range(args.seeds) for name in args.recipes]


def _run(args, name: str, run_cfg, batches, device, dtype, parallel=None, progress=None):
    """One run of the job: (RunResult, the labels whose --export failed)."""
    failed: List[str] = []
    label = _run_label(name, run_cfg, args.seeds)
    result = train_run(name, run_cfg, batches, device, dtype,
                       progress=not args.no_progress if progress is None else progress,
                       parallel=parallel, on_trained=_exporter(
                           args.export, name, label, run_cfg, batches, device, dtype, failed))
    return result, failed


# A --workers process's device, batches and autocast dtype (set once by _start_worker).
_WORKER: dict = {}


def _start_worker(args, devices, threads: int) -> None:
    """Initializer of a --workers process: the next device of the queue ``devices``, ``threads``
    CPU threads, the data and the precision, once for all its runs."""
    device = devices.get()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)
    cfg, max_bytes = _config_from_args(args)
    _WORKER.update(args=args, device=device, batches=_data(args, cfg, max_bytes)[1],
                   dtype=_precision(args.precision, device)[0])


def _worker_run(index: int, name: str, run_cfg):
    w = _WORKER
    return (index, *_run(w["args"], name, run_cfg, w["batches"], w["device"], w["dtype"], progress=False))


def _spread(args, runs, device):
    """The runs on ``args.workers`` processes (spawned), each on its own GPU (cuda:0, cuda:1, ...)
    or, on the CPU, sharing the cores (``--threads`` each, else an equal share of the idle ones);
    yields (index into ``runs``, RunResult, failed exports) as runs finish."""
    ctx = multiprocessing.get_context("spawn")
    devices = ctx.Queue()
    for i in range(args.workers):
        devices.put(torch.device("cuda", i) if device.type == "cuda" else device)
    threads = args.threads or max(1, idle_threads(os.cpu_count() or 1) // args.workers)
    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_start_worker,
                             initargs=(args, devices, threads)) as pool:
        futures = [pool.submit(_worker_run, i, name, run_cfg) for i, (name, run_cfg) in enumerate(runs)]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def _run_label(name: str, cfg, seeds: int) -> str:
    return name if seeds == 1 else f"{name}-seed{cfg.seed}"


def _exporter(directory: Optional[str], name: str, label: str, cfg, batches, device, dtype,
              failed: List[str]):
    """train_run's on_trained for --export: the NVFP4 recipes' models go to DIR/<label>. A
    failure is reported on stderr and appended to ``failed``; the run's results are kept and the
    later runs go on."""
    if directory is None or make_recipe(name, cfg.seed, cfg.backend) is None:
        return None

    def write(model):
        path = os.path.join(directory, label)
        try:
            export_trained(model, cfg, batches, device, dtype, path)
        except Exception as e:  # noqa: BLE001  (any failure of one export: report, go on)
            failed.append(label)
            print(f"{PROG}: {label}: the export to {path} failed ({type(e).__name__}: {e}); "
                  f"the run's results are kept", file=sys.stderr, flush=True)
            return
        print(f"{label}: exported the NVFP4 model to {path} (compressed-tensors)", flush=True)
    return write


def _train_and_report(args, argv, start, cfg, corpus, batches, device, dtype, precision, out,
                      parallel) -> int:
    """The runs of :func:`train_command` with the header, the table and the outputs (rank 0)."""
    meta = _meta(args, argv, cfg, corpus, device, precision, 1 if parallel is None else parallel.world)
    _print_header(cfg, corpus, meta, args.recipes)
    runs, failed, done = _runs(args, cfg), [], {}
    status = 0
    results: List = []
    if args.workers > 1:
        meta["workers"] = args.workers
        finished = _spread(args, runs, device)
    else:
        finished = ((i, *_run(args, name, run_cfg, batches, device, dtype, parallel))
                    for i, (name, run_cfg) in enumerate(runs))
    try:
        for index, result, run_failed in finished:
            done[index] = result
            failed += run_failed
            results = [done[i] for i in sorted(done)]  # in the order of the runs
            print(f"{_run_label(*runs[index], args.seeds)}: {result.status}, {result.quantized}, "
                  f"val loss {result.val_loss:.4f} nats, {result.wall_s:.0f} s, {result.mode} steps",
                  flush=True)
            _write_outputs(out, dict(meta, wall_s=time.perf_counter() - start), results, final=False)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
        current = [_run_label(*run, args.seeds) for i, run in enumerate(runs) if i not in done]
        meta["interrupted"] = f"during run {current[0]!r}"
        print(f"\ninterrupted during {', '.join(map(repr, current[:max(1, args.workers)]))}; keeping "
              f"the {len(results)} finished run(s)", file=sys.stderr)
    meta["wall_s"] = time.perf_counter() - start
    plots = _write_outputs(out, meta, results, final=True)
    if results:
        print("\n" + format_table(results))
        if args.seeds > 1:
            print("\n" + format_seed_table(results))
        if args.seeds > 1 and paired_differences(results):
            print("\n" + format_paired_table(results))
    print(f"\ntotal wall time {meta['wall_s']:.0f} s; wrote {os.path.join(out, 'results.json')}"
          + "".join(f" and {plot}" for plot in plots))
    if failed:
        print(f"{PROG}: the export of {', '.join(failed)} failed (see above)", file=sys.stderr)
    return status or (EXIT_EXPORT_FAILED if failed else 0)

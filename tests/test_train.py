"""The main job, ``nvfp4-recipe train``: it learns on real data, and bad arguments fail clearly."""

import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from nvfp4_recipe import cli
from nvfp4_recipe.train import data as D
from nvfp4_recipe.train import job
from nvfp4_recipe.train.config import RECIPES, TrainConfig
from nvfp4_recipe.train.loop import RunResult
from nvfp4_recipe.train.presets import PRESETS

LN_256 = math.log(256)
ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def _has_matplotlib() -> bool:
    """The plot needs the optional matplotlib (the [plot] extra); without it the run skips the PNG."""
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def _nvfp4_available() -> bool:
    import nvfp4_recipe
    return hasattr(nvfp4_recipe, "quantize_")


def _train(tmp_path, *extra):
    """Run ``nvfp4-recipe train --preset tiny`` in-process, on the CPU unless ``extra`` names a
    ``--device`` (the same run on a GPU machine); returns (exit status, results dict)."""
    out = tmp_path / "out"
    device = () if "--device" in extra else ("--device", "cpu")
    status = cli.main(["train", "--preset", "tiny", "--no-progress", "--out", str(out), *device,
                       *extra])
    path = out / "results.json"
    return status, json.loads(path.read_text()) if path.exists() else None


def test_tiny_training_learns_on_real_text(tmp_path, capsys):
    recipes = ["bf16", "nvfp4"] if _nvfp4_available() else ["bf16"]
    status, results = _train(tmp_path, "--recipes", *recipes)
    assert status == 0
    assert results["command"].startswith("nvfp4-recipe train --preset tiny")
    assert results["data"]["files"] > 10 and results["data"]["val_files"] >= 1
    assert [r["recipe"] for r in results["runs"]] == recipes
    for run in results["runs"]:
        assert run["status"] == "ok"
        steps, losses = zip(*run["val_curve"])
        assert steps[0] == 0 and steps[-1] == run["steps"] == results["config"]["steps"]
        # The untrained model is near uniform over bytes; training must take it well below.
        assert abs(losses[0] - LN_256) < 0.2
        assert losses[-1] < losses[0] - 1.0, losses
        assert run["val_loss"] == losses[-1]
    assert (tmp_path / "out" / "loss_curves.png").exists() == _has_matplotlib()
    table = capsys.readouterr().out
    assert "| recipe" in table and "gap to bf16" in table


@pytest.mark.skipif(not _has_matplotlib(), reason="the plot needs matplotlib")
def test_plot_without_the_baseline_says_so(tmp_path):
    """Without bf16 in --recipes the gap panel has nothing to draw: a note, no legend warning."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, results = _train(tmp_path, "--recipes", "nvfp4-no-sr", "--steps", "10")
    assert status == 0 and [r["recipe"] for r in results["runs"]] == ["nvfp4-no-sr"]
    assert (tmp_path / "out" / "loss_curves.png").exists()
    assert not [w for w in caught if "legend" in str(w.message)]


def test_help_lists_every_recipe_and_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for name in RECIPES:
        assert name in text
    for option in ("--recipes", "--preset", "--data", "--steps", "--d-model", "--device", "--out",
                   "--precision", "--backend", "--seed", "--overwrite"):
        assert option in text


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A run sets torch's thread count; give the next test the one it had."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"nvfp4-recipe {importlib.metadata.version('nvfp4-recipe')}\n"


@pytest.mark.parametrize("seed", ["-1", "2147483648", "1.5", "x"])
def test_seed_out_of_range_is_refused_by_argparse(capsys, seed):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--seed", seed])
    assert e.value.code == cli.EXIT_USAGE
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"nvfp4-recipe train: error: argument --seed: must be an int in [0, 2**31), got {seed}")


def test_seed_range_ends():
    parse = cli.build_parser().parse_args
    assert parse(["train", "--seed", "0"]).seed == 0
    assert parse(["train", "--seed", str(2**31 - 1)]).seed == 2**31 - 1


@pytest.mark.parametrize("cpus, load, most, want", [
    (2, 0.1, 2, 2), (2, 1.2, 2, 1), (2, 3.5, 2, 1), (8, 3.4, 8, 5), (8, 0.0, 4, 4)])
def test_idle_threads_leave_the_busy_cores_out(monkeypatch, cpus, load, most, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert job.idle_threads(most) == want


def test_run_threads_default_to_the_idle_cores_and_follow_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "train_run", _fake_run)
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 0.0, 0.0))  # every core busy
    torch.set_num_threads(2)
    status, results = _train(tmp_path / "busy", "--recipes", "bf16")
    assert status == 0 and results["hardware"].endswith(", 1 torch threads")
    status, results = _train(tmp_path / "given", "--recipes", "bf16", "--threads", "2")
    assert status == 0 and results["hardware"].endswith(", 2 torch threads")


def _listed(names):
    """Patterns of the help lines that start with each of ``names`` (the recipe and preset lists)."""
    return [rf"(?m)^ +{re.escape(name)} " for name in names]


@pytest.mark.parametrize("args, patterns", [
    (["--help"], [r"^usage: nvfp4-recipe", r"\btrain\b"]),
    (["train", "--help"], _listed(RECIPES) + _listed(PRESETS)),
    (["--version"], [rf"^nvfp4-recipe {re.escape(importlib.metadata.version('nvfp4-recipe'))}\n$"]),
])
def test_help_and_version_answer_without_importing_torch(args, patterns):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "nvfp4_recipe", *args],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    modules = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")]
    assert modules and not [m for m in modules if m.split(".")[0] == "torch"]
    for pattern in patterns:
        assert re.search(pattern, proc.stdout), (pattern, proc.stdout)


@pytest.mark.parametrize("args, message", [
    (["--recipes", "bf16", "nvfp4-typo"],
     "nvfp4-recipe train: error: unknown recipe 'nvfp4-typo'; choose from " + ", ".join(RECIPES)),
    (["--data", "/no/such/dir"], "nvfp4-recipe train: error: data directory not found: /no/such/dir"),
    (["--d-model", "100"], "nvfp4-recipe train: error: --d-model must be a positive multiple of 16 "
                           "(NVFP4 blocks are 16 wide), got 100"),
    (["--no-stdlib"], "nvfp4-recipe train: error: --no-stdlib needs --data DIR"),
    (["--lr", "nan"], "nvfp4-recipe train: error: --lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "nvfp4-recipe train: error: --lr must be a finite number > 0, got inf"),
    (["--max-mb", "nan"], "nvfp4-recipe train: error: --max-mb must be a finite number >= 0, got nan"),
    (["--backend", "native"], "nvfp4-recipe train: error: NVFP4 backend 'native' cannot run here: "
                              "the native backend needs a CUDA device, got cpu"),
    (["--experts", "0"], "nvfp4-recipe train: error: --experts must be >= 1 (leave out --moe, "
                         "--experts and --top-k for a dense model), got 0"),
    (["--seeds", "0"], "nvfp4-recipe train: error: --seeds must be >= 1 with --seed + --seeds <= "
                       "2**31, got 0"),
    (["--quant-stats-every", "-1"],
     "nvfp4-recipe train: error: --quant-stats-every must be >= 0 (0: off), got -1"),
    (["--device", "cpu", "--mode", "graph"],
     "nvfp4-recipe train: error: --mode graph needs a CUDA device (CUDA graphs), got cpu"),
])
def test_bad_arguments_fail_with_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(job, "train_run", _no_training)
    status, results = _train(tmp_path, *args)
    assert status == cli.EXIT_USAGE
    assert capsys.readouterr().err == message + "\n"
    assert results is None


def _no_training(*args, **kwargs):
    raise AssertionError("a bad argument must fail before any training")


def test_unavailable_backend_fails_before_any_training(tmp_path, capsys, monkeypatch,
                                                      without_triton_interpreter):
    """--backend triton on a CPU (without the Triton interpreter the tests use) fails at once,
    not after the bf16 run."""
    monkeypatch.setattr(job, "train_run", _no_training)
    status, results = _train(tmp_path, "--backend", "triton", "--device", "cpu")
    assert status == cli.EXIT_USAGE and results is None
    assert capsys.readouterr().err == ("nvfp4-recipe train: error: NVFP4 backend 'triton' cannot run "
                                       "here: the triton backend needs a CUDA device, got cpu\n")
    monkeypatch.setattr(job, "train_run", _fake_run)  # bf16 alone does not use the backend
    assert _train(tmp_path, "--backend", "triton", "--device", "cpu", "--recipes", "bf16")[0] == 0


def test_out_must_be_a_writable_directory_without_earlier_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(job, "train_run", _fake_run)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, message in ((a_file, "exists and is not a directory"),
                         (a_file / "sub", "cannot write there: Not a directory")):
        assert cli.main(["train", "--recipes", "bf16", "--out", str(out)]) == cli.EXIT_USAGE
        assert capsys.readouterr().err == f"nvfp4-recipe train: error: --out {out}: {message}\n"
    status, first = _train(tmp_path, "--recipes", "bf16")
    assert status == 0
    status, again = _train(tmp_path, "--recipes", "bf16")
    assert status == cli.EXIT_USAGE and again == first  # the earlier results are kept
    assert "already holds results.json of an earlier run; choose another --out or pass --overwrite" in (
        capsys.readouterr().err)
    status, replaced = _train(tmp_path, "--recipes", "bf16", "--overwrite")
    assert status == 0 and replaced["date"] >= first["date"] and replaced["command"].endswith("--overwrite")


def _fake_run(recipe, cfg, batches, device, dtype, progress=True, parallel=None, on_trained=None):
    """Stands in for loop.train_run: bf16 'finishes' at once, any other recipe is interrupted."""
    if recipe != "bf16":
        raise KeyboardInterrupt
    return RunResult(recipe, "ok", steps=2, params=1, quantized="0/1", train_loss=3.0, val_loss=3.5,
                     mode="eager",
                     tokens_per_s=1.0, peak_memory_bytes=None, wall_s=0.1, train_curve=[4.0, 3.0],
                     val_curve=[[0, 5.5], [2, 3.5]])


def test_without_matplotlib_the_run_writes_json_and_says_why_no_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(job, "train_run", _fake_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    status, results = _train(tmp_path, "--recipes", "bf16")
    assert status == 0 and [r["recipe"] for r in results["runs"]] == ["bf16"]
    assert not (tmp_path / "out" / "loss_curves.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_interrupt_keeps_finished_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "train_run", _fake_run)
    status, results = _train(tmp_path, "--recipes", "bf16", "nvfp4-no-sr")
    assert status == cli.EXIT_INTERRUPTED
    assert [r["recipe"] for r in results["runs"]] == ["bf16"]
    assert "nvfp4-no-sr" in results["interrupted"]
    assert (tmp_path / "out" / "loss_curves.png").exists() == _has_matplotlib()


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    files = []
    for i in range(40):
        path = tmp_path / f"m{i}.py"
        path.write_bytes(b"x = %d\n" % i * (i + 1))
        files.append((str(path), path.stat().st_size))
    train, val = D.split_files(files, 0.1, seed=3)
    assert (train, val) == D.split_files(list(reversed(files)), 0.1, seed=3)
    assert val != D.split_files(files, 0.1, seed=4)[1]
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    sizes = dict(files)
    assert sum(sizes[p] for p in val) >= 0.1 * sum(sizes.values())
    corpus = D.load_corpus([str(tmp_path)], use_stdlib=False, val_fraction=0.1, seed=3)
    assert corpus.train_files == len(train) and corpus.val_files == len(val)
    assert corpus.train.numel() == sum(sizes[p] + 1 for p in train)  # + one separator per file


@pytest.mark.cuda
@pytest.mark.parametrize("model", [(), ("--moe",)], ids=["dense", "moe"])
def test_graph_mode_gives_the_eager_numbers(tmp_path, model):
    """The whole step captured in a CUDA graph computes what the eager loop computes: the same
    training and validation losses, bit for bit, for bf16 and NVFP4 (SR streams advance per
    replay), dense and MoE (the routing's group sizes stay on the device), and the run says which
    mode ran; so do the quantization statistics, recorded in a second graph (dense) or eagerly
    (MoE)."""
    runs = {}
    for mode in ("eager", "graph"):
        status, results = _train(tmp_path / mode, "--recipes", "bf16", "nvfp4", "--device", "cuda",
                                 "--mode", mode, "--steps", "24", "--eval-every", "12",
                                 "--quant-stats-every", "5", *model)
        assert status == 0
        runs[mode] = results["runs"]
    for eager, graph in zip(runs["eager"], runs["graph"], strict=True):
        assert (eager["mode"], graph["mode"]) == ("eager", "graph")
        assert eager["train_curve"] == graph["train_curve"]
        assert eager["val_curve"] == graph["val_curve"]
        assert eager["quant_stats"] == graph["quant_stats"]
    assert [h["step"] for h in runs["graph"][1]["quant_stats"]] == [0, 5, 10, 15, 20]


def test_step_mode_picks_graph_on_one_gpu_and_compile_under_torchrun():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = TrainConfig(mode="auto")
    assert auto.step_mode(cuda) == "graph"
    assert auto.step_mode(cuda, data_parallel=True) == "compile"
    assert auto.step_mode(cpu) == "eager" and auto.step_mode(cpu, data_parallel=True) == "eager"
    assert TrainConfig(mode="compile").step_mode(cpu, data_parallel=True) == "compile"
    with pytest.raises(ValueError, match="CUDA"):
        TrainConfig(mode="graph").step_mode(cpu)
    with pytest.raises(ValueError, match="torchrun"):
        TrainConfig(mode="graph").step_mode(cuda, data_parallel=True)
    assert TrainConfig(mode="eager").step_mode(cuda, data_parallel=True) == "eager"
    assert TrainConfig(mode="auto", n_experts=4).step_mode(cuda) == "graph"
    assert TrainConfig(mode="graph", n_experts=4).step_mode(cuda) == "graph"


@pytest.mark.parametrize("model", [(), ("--moe",)], ids=["dense", "moe"])
def test_compile_mode_trains_as_eager(tmp_path, model):
    """--mode compile compiles each transformer block (the run's results say so); the NVFP4
    kernels are the eager ones, Inductor's fused bf16 arithmetic around them rounds differently:
    the first step's loss (before any update) agrees to 1e-4 relative (about 40 bf16 roundings
    averaged over 512 tokens), the losses after 20 steps to 1% (a tenth of the tiny preset's
    single-seed spread)."""
    runs = {}
    for mode in ("eager", "compile"):
        status, results = _train(tmp_path / mode, "--recipes", "nvfp4", "--mode", mode,
                                 "--steps", "20", "--eval-every", "10", *model)
        assert status == 0
        runs[mode] = results["runs"][0]
    eager, compiled = runs["eager"], runs["compile"]
    assert (eager["mode"], compiled["mode"]) == ("eager", "compile")
    assert abs(compiled["train_curve"][0] - eager["train_curve"][0]) <= 1e-4 * eager["train_curve"][0]
    assert abs(compiled["val_loss"] - eager["val_loss"]) <= 0.01 * eager["val_loss"]


def _seeded_run(recipe, cfg, batches, device, dtype, progress=True, parallel=None, on_trained=None):
    """Stands in for loop.train_run: a validation loss made of the recipe and the seed."""
    val = {"bf16": 3.0, "nvfp4-no-sr": 3.3}[recipe] + 0.1 * cfg.seed
    return RunResult(recipe, "ok", steps=2, params=1, quantized="0/1", train_loss=val, val_loss=val,
                     mode="eager", tokens_per_s=1.0, peak_memory_bytes=None, wall_s=0.1,
                     seed=cfg.seed, train_curve=[4.0, val], val_curve=[[0, 5.5], [2, val]])


def test_seeds_train_each_recipe_per_seed_and_table_the_mean_and_std(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(job, "train_run", _seeded_run)
    status, results = _train(tmp_path, "--recipes", "bf16", "nvfp4-no-sr", "--seeds", "3", "--seed", "4")
    assert status == 0
    assert [(r["recipe"], r["seed"]) for r in results["runs"]] == [
        (name, seed) for seed in (4, 5, 6) for name in ("bf16", "nvfp4-no-sr")]
    for r in results["runs"]:  # each run's gap is to the baseline of its own seed
        base = 3.0 + 0.1 * r["seed"]
        assert r["val_gap_to_baseline"] == pytest.approx((r["val_loss"] - base) / base)
    out = capsys.readouterr().out
    vals = [3.3 + 0.1 * s for s in (4, 5, 6)]
    gaps = [100 * 0.3 / (3.0 + 0.1 * s) for s in (4, 5, 6)]
    mean = lambda v: sum(v) / 3
    std = lambda v: math.sqrt(sum((x - mean(v)) ** 2 for x in v) / 2)
    row = f"| nvfp4-no-sr | 3    | {mean(vals):.4f} +- {std(vals):.4f} | {mean(gaps):+.2f} +- {std(gaps):.2f} % |"
    assert row in out, out
    assert "| bf16 (seed 5)" in out


@pytest.mark.skipif(not _nvfp4_available(), reason="needs the NVFP4 layers")
def test_every_recipe_trains_on_the_tiny_preset(tmp_path):
    from nvfp4_recipe.train.config import RECIPES
    status, results = _train(tmp_path, "--recipes", *RECIPES, "--steps", "4", "--eval-every", "4")
    assert status == 0 and [r["recipe"] for r in results["runs"]] == list(RECIPES)
    for run in results["runs"]:
        assert run["status"] == "ok" and math.isfinite(run["val_loss"]), run["recipe"]
        assert run["val_loss"] < run["val_curve"][0][1]


def _paired_run(recipe, cfg, batches, device, dtype, progress=True, parallel=None, on_trained=None):
    """Stands in for loop.train_run: validation losses with a seed effect every recipe shares and
    recipe effects that differ from nvfp4's by known amounts per seed."""
    seed_effect = {0: 0.0, 1: 0.5, 2: -0.3, 3: 0.2}[cfg.seed]
    val = {"bf16": 3.0, "nvfp4": 3.06, "nvfp4-no-sr": 3.06 + 0.003 * (cfg.seed + 1)}[recipe] + seed_effect
    return RunResult(recipe, "ok", steps=2, params=1, quantized="0/1", train_loss=val, val_loss=val,
                     mode="eager", tokens_per_s=1.0, peak_memory_bytes=None, wall_s=0.1,
                     seed=cfg.seed, train_curve=[4.0, val], val_curve=[[0, 5.5], [2, val]])


def test_paired_differences_to_nvfp4_with_their_95_percent_interval(tmp_path, monkeypatch, capsys):
    """Per seed s the no-SR run's gap minus nvfp4's gap is (v_nosr - v_nvfp4) / v_bf16 =
    0.003 (s + 1) / (3 + seed effect): the table, results.json and gaps.png give their mean and
    t-interval (t 0.975 with 3 degrees of freedom: 3.182)."""
    monkeypatch.setattr(job, "train_run", _paired_run)
    status, results = _train(tmp_path, "--recipes", "bf16", "nvfp4", "nvfp4-no-sr", "--seeds", "4")
    assert status == 0
    base = {s: 3.0 + e for s, e in {0: 0.0, 1: 0.5, 2: -0.3, 3: 0.2}.items()}
    d = [100 * 0.003 * (s + 1) / base[s] for s in range(4)]
    mean = sum(d) / 4
    half = 3.182 * math.sqrt(sum((x - mean) ** 2 for x in d) / 3) / 2
    paired = results["paired_to_nvfp4"]
    assert list(paired) == ["nvfp4-no-sr"]
    got = paired["nvfp4-no-sr"]
    assert got["n"] == 4 and got["per_seed"] == {str(s): pytest.approx(d[s]) for s in range(4)}
    assert got["mean"] == pytest.approx(mean) and got["half_width"] == pytest.approx(half)
    assert f"| nvfp4-no-sr | 4     | {mean:+.2f} +- {half:.2f} pp " in capsys.readouterr().out
    assert (tmp_path / "out" / "gaps.png").exists() == _has_matplotlib()


def test_t_quantiles_of_the_interval():
    from nvfp4_recipe.train.report import interval, t975
    assert t975(1) == 12.706 and t975(30) == 2.042
    assert abs(t975(31) - 2.0395) < 1e-4 and abs(t975(120) - 1.9799) < 1e-4  # tables: 2.0395, 1.9799
    assert interval([1.0]).n == 1 and math.isnan(interval([1.0]).half_width)
    assert interval([1.0, 3.0]) == (2, 2.0, pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2)))


@pytest.mark.skipif(not _nvfp4_available(), reason="needs the NVFP4 layers")
def test_workers_spread_the_runs_and_give_the_sequential_numbers(tmp_path, capsys):
    """--workers 2 trains the four runs in two spawned processes (on the CPU here; one GPU each
    on a GPU machine) and reports them in the runs' order with the numbers of one process: the
    same device, thread count and seeds give the same bits."""
    args = ("--recipes", "bf16", "nvfp4", "--seeds", "2", "--steps", "6", "--eval-every", "3",
            "--threads", "1")
    status, spread = _train(tmp_path / "spread", *args, "--workers", "2")
    assert status == 0 and spread["workers"] == 2
    status, one = _train(tmp_path / "one", *args)
    assert status == 0
    key = lambda r: (r["recipe"], r["seed"], r["val_curve"], r["train_curve"])
    assert [key(r) for r in spread["runs"]] == [key(r) for r in one["runs"]]
    assert "paired_to_nvfp4" in spread


@pytest.mark.parametrize("extra, message", [
    (("--workers", "0"), "--workers must be >= 1, got 0"),
    (("--workers", "2", "--device", "cuda:1"), None),
])
def test_bad_workers_are_refused(tmp_path, capsys, extra, message):
    if message is None and not torch.cuda.is_available():
        message = "CUDA is not available"
    elif message is None:
        message = "pass --device cuda, not cuda:1"
    status, _ = _train(tmp_path, "--recipes", "bf16", *extra)
    assert status == 2 and message in capsys.readouterr().err


def test_split_seed_lets_one_seed_of_a_study_run_alone(tmp_path):
    """--seed 1 --split-seed 0 is the seed-1 run of --seed 0 --seeds 2: same files, same loss."""
    _, study = _train(tmp_path / "study", "--recipes", "bf16", "--seeds", "2", "--steps", "6")
    _, alone = _train(tmp_path / "alone", "--recipes", "bf16", "--seed", "1", "--split-seed", "0",
                      "--steps", "6")
    _, other = _train(tmp_path / "other", "--recipes", "bf16", "--seed", "1", "--steps", "6")
    assert alone["data"]["val_files"] == study["data"]["val_files"] != other["data"]["val_files"]
    assert alone["data"]["split_seed"] == 0 and other["data"]["split_seed"] == 1
    assert alone["runs"][0]["seed"] == study["runs"][1]["seed"] == 1
    assert alone["runs"][0]["val_loss"] == study["runs"][1]["val_loss"]
    assert alone["runs"][0]["val_loss"] != other["runs"][0]["val_loss"]


@pytest.mark.skipif(not _nvfp4_available(), reason="needs the NVFP4 layers")
def test_quant_stats_are_recorded_in_results_and_plotted(tmp_path):
    status, results = _train(tmp_path, "--recipes", "bf16", "nvfp4-4over6", "--steps", "20",
                             "--quant-stats-every", "10")
    assert status == 0
    bf16, nvfp4 = results["runs"]
    assert bf16["quant_stats"] == []
    assert [h["step"] for h in nvfp4["quant_stats"]] == [0, 10]
    layer = nvfp4["quant_stats"][1]["layers"]["blocks.0.mlp.fc1"]
    assert set(layer) == {"w", "x", "xt", "dy", "dyt"}
    assert 0 < layer["x"]["relative_mse"] < 0.1 and 0 <= layer["x"]["mapped_to_4"] <= 1
    assert "mapped_to_4" not in layer["dy"]  # 4/6 on the weights and activations only
    assert (tmp_path / "out" / "quant_stats.png").exists() == _has_matplotlib()


@pytest.mark.parametrize("name", ["nvfp4-4over6", "nvfp4-4over6-all", "nvfp4-tail", "nvfp4-fwd-only",
                                  "nvfp4-bwd-only", "nvfp4-fwd-only-1d-weights", "nvfp4-fwd-only-4over6",
                                  "nvfp4-4over6-tail"])
def test_the_recipes_of_the_field_are_in_the_table(name):
    from nvfp4_recipe.train.recipes import make_recipe
    recipe = make_recipe(name, 0, "auto")
    assert recipe != make_recipe("nvfp4", 0, "auto") and name in cli._recipe_help()

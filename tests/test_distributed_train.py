"""``nvfp4-recipe train`` under torchrun: 2 CPU processes (gloo) train data-parallel on the tiny
preset, rank 0 reports, and the run is the single-process one with the same global batches."""

import json
import os
import pathlib
import subprocess
import sys

from nvfp4_recipe import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["train", "--preset", "tiny", "--recipes", "bf16", "nvfp4", "--steps", "8",
        "--eval-every", "4", "--device", "cpu", "--precision", "fp32", "--no-progress"]


def _torchrun(out, *args):
    """The main job under torchrun on 2 processes. Inductor's cache is the run's own: a pytest
    worker compiling the same kernels beside it once left a half-written library in the shared
    one ("file too short")."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TORCHINDUCTOR_CACHE_DIR=str(out.parent / f"{out.name}_inductor"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "nvfp4_recipe", *args, "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_torchrun_two_processes_train_as_one_with_the_same_global_batches(tmp_path, capsys):
    """Each rank trains on half of every global batch and DDP averages the gradients. In fp32
    ("bf16" recipe, --precision fp32) that is the single-process optimization up to the rounding
    of the averaged gradient: losses agree to 1e-6 relative (fp32 level; AdamW turns
    rounding-level gradient differences into rounding-level updates over 8 steps). Under NVFP4
    the ranks also quantize activations with the amax of their own tokens and draw their own SR
    streams, so the run differs by NVFP4-level noise: validation losses within 1% (measured
    about 0.1%), and it still learns."""
    two = tmp_path / "two"
    proc = _torchrun(two, *ARGS)
    assert proc.stdout.count("| recipe") == 1 and "x 2 processes (DDP)" in proc.stdout
    assert cli.main([*ARGS, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    got = json.loads((two / "results.json").read_text())
    assert (got["processes"], one["processes"]) == (2, 1)
    (bf16, nvfp4), (bf16_one, nvfp4_one) = got["runs"], one["runs"]
    assert all(r["status"] == "ok" for r in (bf16, nvfp4))
    for a, b in zip(bf16["train_curve"], bf16_one["train_curve"], strict=True):
        assert abs(a - b) <= 1e-6 * b
    for (step, a), (_, b) in zip(bf16["val_curve"], bf16_one["val_curve"], strict=True):
        assert abs(a - b) <= 1e-6 * b, step
    assert abs(nvfp4["val_loss"] - nvfp4_one["val_loss"]) < 0.01 * nvfp4_one["val_loss"]
    assert nvfp4["val_curve"][-1][1] < nvfp4["val_curve"][0][1] - 1.0


def test_torchrun_compiles_each_block_inside_ddp(tmp_path, capsys):
    """--mode compile under torchrun (the default there on CUDA): each rank compiles its blocks,
    DDP's hooks still average the gradients. Against one eager process on the same global batches
    the NVFP4 run differs by the per-rank amaxes and SR streams (as in the test above) and by
    Inductor's rounding: validation losses within 1%."""
    args = [a for a in ARGS if a != "bf16"]
    _torchrun(tmp_path / "two", *args, "--mode", "compile")
    assert cli.main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    (got,) = json.loads((tmp_path / "two" / "results.json").read_text())["runs"]
    (one,) = json.loads((tmp_path / "one" / "results.json").read_text())["runs"]
    assert (got["mode"], one["mode"]) == ("compile", "eager") and got["status"] == "ok"
    assert abs(got["val_loss"] - one["val_loss"]) < 0.01 * one["val_loss"]

"""The package as installed: a silent import, and the metadata pip reads."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import nvfp4_recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
    """This process's environment without TORCHAO_FORCE_SKIP_LOADING_SO_FILES, the checkout first
    on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run(*args):
    return subprocess.run([sys.executable, "-W", "error", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT)


def test_import_prints_nothing_and_leaves_the_environment_alone():
    proc = _run("-c", "import os, nvfp4_recipe; print(os.environ.get('TORCHAO_FORCE_SKIP_LOADING_SO_FILES'))")
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("None\n", "")


def test_torchao_decides_its_compiled_extensions_itself():
    """Importing the package imports torchao as torchao imports itself: with torch >= 2.11 it
    tries its compiled extensions (a process that also trains with torchao's kernels keeps them),
    and the user's TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 is still honoured."""
    code = "import nvfp4_recipe, torchao; print(torchao.skip_loading_so_files)"
    alone = subprocess.run([sys.executable, "-c", "import torchao; print(torchao.skip_loading_so_files)"],
                           capture_output=True, text=True, env=_env(), cwd=ROOT)
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == alone.stdout
    forced = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**_env(), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert forced.stdout == "True\n", forced.stderr


def test_cli_help_prints_only_the_help():
    proc = _run("-m", "nvfp4_recipe", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: nvfp4-recipe") and proc.stderr == ""


def test_pyproject_license_and_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert any(d.startswith("transformers") for d in project["optional-dependencies"]["test"])
    # every declared dependency is imported by the package
    imported = set()
    for path in (ROOT / "nvfp4_recipe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    for dep in project["dependencies"]:
        name = re.match(r"[\w.-]+", dep).group()
        assert name in imported, f"{name} is declared but never imported"


# the step run with and without Triton: quantize_, a training step, an evaluation under
# cached_weights, on the reference backend
_STEP = """
import torch
from torch import nn


def step(nr):
    torch.manual_seed(0)
    model = nr.quantize_(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)),
                         nr.NVFP4Recipe(backend="reference"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    with torch.no_grad(), nr.cached_weights():
        y = model(torch.randn(3, 32))
    return {"state": model.state_dict(), "y": y}
"""

# Triton blocked, as where pyproject does not install it: the step saved, the modules that need
# Triton that were imported, and what the backends that need it say
_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError; find_spec finds nothing
import nvfp4_recipe as nr
from nvfp4_recipe.backends import get_backend
torch.save(step(nr), sys.argv[1])
print(sorted(m for m, module in sys.modules.items() if module is not None and (
    m.startswith(("triton", "nvfp4_recipe.kernels")) or m == "nvfp4_recipe.backends.triton")))
for name in ("triton", "native"):
    try:
        get_backend(name, "cpu")
    except ValueError as e:
        print(e)
"""


def test_the_reference_backend_runs_without_triton(tmp_path):
    """pyproject installs Triton on Linux only. With triton not importable the package imports,
    a model trains and evaluates on the reference backend with the bits it has where Triton is
    installed, no module that needs Triton is imported, and the backends that need it are refused
    with a message naming it."""
    out = tmp_path / "without_triton.pt"
    proc = _run("-c", _STEP + _WITHOUT_TRITON, str(out))
    assert proc.returncode == 0, proc.stderr
    imported, *refusals = proc.stdout.splitlines()
    assert imported == "[]"
    assert len(refusals) == 2 and all(
        f"NVFP4 backend {name!r} cannot run here: the {name} backend needs triton, which is not "
        f"installed" in line for name, line in zip(("triton", "native"), refusals))
    here = {}
    exec(_STEP, here)
    want, got = here["step"](nvfp4_recipe), torch.load(out)
    assert int(got["state"]["0.sr_step"]) == 1 and torch.equal(got["y"], want["y"])
    assert got["state"].keys() == want["state"].keys()
    assert all(torch.equal(got["state"][k], want["state"][k]) for k in want["state"])

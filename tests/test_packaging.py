"""The package as installed: a silent import, and the metadata pip reads."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

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

"""The layering contract (pyproject's `[tool.importlinter]`) holds, and it catches an upward
import.

import-linter reads a package from one folder, but clora installs from several
(pyproject's `package-dir`: `core/` is `clora`, `ingest/` is `clora.ingest`, ...). So the
check assembles the package as it installs, by copying each folder to its place in a
temporary tree, and runs `lint-imports` there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def assemble(dest: Path) -> Path:
    """Copy the sources into `dest/clora/...` as pyproject's package-dir maps them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(exe), str(tree / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return assemble(tmp_path_factory.mktemp("layers"))


def test_the_assembled_tree_is_the_installed_package(tree):
    out = subprocess.run([sys.executable, "-c", "import clora, clora.ingest; print(clora.__file__)"],
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent == tree / "clora"


def test_the_code_keeps_the_layering_contract(tree):
    out = lint_imports(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    report = " ".join(out.stdout.split())
    assert "0 broken" in report and "BROKEN" not in report


@pytest.mark.parametrize(("module", "upward", "contract"), [
    ("ingest/worker.py", "import clora.infra.cli", "nothing imports the top"),
    ("serving/gateway.py", "import clora.learner.trainer", "nothing imports the top"),
    ("learner/publish.py", "import clora.serving.aliases", "nothing imports the top"),
    ("agents/runtime.py", "import clora.infra.demo", "nothing imports the top"),
    ("core/registry.py", "import clora.ingest.schemas", "the ground imports nothing of ours"),
    ("kernels/segments.py", "import clora.ids", "kernels import nothing of ours"),
    ("ingest/buffers.py", "import torch", "ingest knows no trainer and no engine"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, upward, contract):
    tree = assemble(tmp_path)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package = next(p for p, folder in config["tool"]["setuptools"]["package-dir"].items()
                   if folder == module.split("/")[0])
    path = tree.joinpath(*package.split("."), module.split("/", 1)[1])
    path.write_text(path.read_text() + f"\n{upward}  # a deliberate violation\n")
    out = lint_imports(tree)
    assert out.returncode != 0, out.stdout
    report = " ".join(out.stdout.split())  # the report wraps long contract names
    assert f"{contract} BROKEN" in report, out.stdout

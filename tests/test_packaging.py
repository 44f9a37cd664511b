"""clora installs under one namespace: its parts are `clora.kernels`, `clora.agents`, ...,
and leave generic top-level names such as `kernels` and `agents` free."""

from __future__ import annotations

import subprocess
import sys


def test_generic_module_names_stay_free(tmp_path):
    """Whatever `kernels` and `agents` resolve to, it is not ours (the OpenAI Agents SDK, a test
    dependency, is `agents`)."""
    from pathlib import Path

    code = ("import importlib.util as u, clora.ingest, clora.kernels, clora.agents;"
            "print(*[(s.origin if s else None) for s in (u.find_spec('kernels'), u.find_spec('agents'))])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    root = Path(__file__).resolve().parents[1]
    for origin in out.stdout.split():
        assert origin == "None" or not Path(origin).resolve().is_relative_to(root / "kernels") \
            and not Path(origin).resolve().is_relative_to(root / "agents"), origin


def test_the_data_files_the_platform_reads_ship_in_the_wheel(tmp_path):
    """Package data an installed clora reads at run time: the console's static files and the
    forgetting guard's prompt set (`[tool.setuptools.package-data]` in pyproject.toml)."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    import tomllib

    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in sorted(set(package_dir.values())):   # every folder the wheel is built from
        shutil.copytree(root / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    code = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=src, capture_output=True,
                         text=True, check=True)
    names = set(zipfile.ZipFile(tmp_path / "dist" / out.stdout.strip().splitlines()[-1]).namelist())
    assert {"clora/learner/drift_prompts.jsonl", "clora/infra/static/console.js"} <= names

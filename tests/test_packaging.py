"""clora installs under one namespace: its parts are `clora.kernels`, `clora.agents`, ...,
and leave generic top-level names such as `kernels` and `agents` free."""

from __future__ import annotations

import subprocess
import sys


def test_generic_module_names_stay_free(tmp_path):
    code = ("import importlib.util as u, clora.ingest, clora.kernels, clora.agents;"
            "print(u.find_spec('kernels'), u.find_spec('agents'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None None"

"""clora.kernels imports nothing else of clora's, and picks no backend at import time."""

from __future__ import annotations

import os
import subprocess
import sys


def test_kernels_import_no_other_clora_package():
    code = (
        "import sys, clora.kernels; "
        "print(sorted(m for m in sys.modules if m.startswith('clora.') and not m.startswith('clora.kernels')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", f"clora.kernels pulled in other clora packages: {out.stdout}"


def test_triton_backend_interprets_cpu_tensors_even_if_imported_without_triton_interpret():
    """The interpreter choice is made when the backend is built, not when triton is imported."""
    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import torch\n"
        "from clora.kernels import SegmentMeta, TritonBackend, TorchBackend\n"
        "meta = SegmentMeta.from_token_adapter_ids([1, 0, 1, -1], 2)\n"
        "x, w = torch.randn(4, 16), torch.randn(2, 16, 16)\n"
        "got = TritonBackend(interpret=True).segmented_mm(meta.to_sorted(x), w, meta)\n"
        "ref = TorchBackend().segmented_mm(meta.to_sorted(x), w, meta)\n"
        "print(float((got - ref).abs().max()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) < 1e-5

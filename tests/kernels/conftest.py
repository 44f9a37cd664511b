"""Kernel test setup: the Triton interpreter on CPU and the two backends as fixtures.

`TRITON_INTERPRET=1` is set before triton is imported when no CUDA device is present
(`TritonBackend` also picks the interpreter itself for CPU tensors, so the order of
imports across the suite cannot break these tests). Shared cases live in `kernel_cases`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Test modules import their shared cases (`kernel_cases`); under --import-mode=importlib
# pytest does not put this folder on sys.path, so do it here (the name is unique).
sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from clora.kernels import TorchBackend, TritonBackend  # noqa: E402


@pytest.fixture(scope="session")
def triton_backend() -> TritonBackend:
    return TritonBackend()  # interpreter without CUDA, compiled kernels with it


@pytest.fixture(scope="session")
def torch_backend() -> TorchBackend:
    return TorchBackend()

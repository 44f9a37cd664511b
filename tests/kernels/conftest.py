"""Kernel test setup: the Triton interpreter on CPU and the Triton backend as a fixture.

`TRITON_INTERPRET=1` is set before triton is imported when no CUDA device is present
(`TritonBackend` also picks the interpreter itself for CPU tensors, so the order of
imports across the suite cannot break these tests). Shared cases live in
`tests.kernels.kernel_cases`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from clora.kernels import TritonBackend  # noqa: E402


@pytest.fixture(scope="session")
def triton_backend() -> TritonBackend:
    return TritonBackend()  # interpreter without CUDA, compiled kernels with it

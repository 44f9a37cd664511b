"""The CPU copy engine's thread must not open an OpenMP team of its own (see
`clora.learner.copy_engine.serial_openmp_thread`): with two teams on a machine with as many
cores as one team, libgomp sleeps at every barrier and training steps ran 1.8x slower
(SmolLM2, 2 cores, `benchmarks/bench_learner.py`)."""

from __future__ import annotations

import pytest
import torch

from clora.learner.copy_engine import ThreadCopyEngine, _openmp_runtimes


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not _openmp_runtimes(), reason="torch was built without an OpenMP runtime here")
def test_copy_thread_runs_single_threaded_and_leaves_the_training_threads_alone(two_threads):
    engine = ThreadCopyEngine()
    seen: list[int] = []
    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    engine.submit(lambda: (dst.copy_(src), seen.append(torch.get_num_threads()))).wait()
    engine.close()
    assert seen == [1], "the copy thread would start a second OpenMP team"
    assert torch.get_num_threads() == 2, "the training thread lost its threads"
    assert torch.equal(dst, src)

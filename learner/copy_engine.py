"""Copy engines: how the adapter store moves tenant state between host and device.

A copy engine runs copy jobs in submission order (FIFO), so "write tenant A back, then load
tenant B into the same slot" is always safe. Three backends, chosen when the store is built:

- `SyncCopyEngine`: copies immediately on the caller's thread (the no-prefetch baseline).
- `ThreadCopyEngine` (CPU): one background thread; `Tensor.copy_` releases the GIL, so a
  copy overlaps with the training step running on the main thread.
- `CudaStreamCopyEngine` (GPU): a side CUDA stream; each job first waits for the compute
  stream's work submitted so far, and the compute stream waits on the job's event when the
  result is needed. Host buffers are pinned, so `non_blocking` copies are truly async.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch


class CopyHandle(Protocol):
    def wait(self) -> None:
        """Block (or make the compute stream wait) until the job's copies are done."""


class CopyEngine(Protocol):
    def submit(self, job: Callable[[], None]) -> CopyHandle: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class SyncCopyEngine:
    """Runs each job immediately; `wait` is free. The baseline without prefetch."""

    def submit(self, job: Callable[[], None]) -> CopyHandle:
        job()
        return _Done()

    def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class _FutureHandle:
    def __init__(self, fut: Future):
        self._fut = fut

    def wait(self) -> None:
        self._fut.result()  # re-raises the copy's exception, with its traceback as cause


@functools.cache
def _openmp_runtimes() -> tuple[ctypes.CDLL, ...]:
    """The OpenMP runtimes this process has loaded (torch's libgomp on Linux), by their maps."""
    try:
        maps = open("/proc/self/maps").read().split("\n")
    except OSError:
        return ()
    paths = {line.split()[-1] for line in maps if any(n in line for n in ("libgomp", "libiomp", "libomp"))}
    runtimes = (ctypes.CDLL(p) for p in sorted(paths))
    return tuple(r for r in runtimes if hasattr(r, "omp_set_num_threads"))


def serial_openmp_thread() -> None:
    """Make the calling thread's torch ops run without an OpenMP team of their own.

    A copy thread whose large `copy_` opens a parallel region gets a second OpenMP team: the
    process then holds more OpenMP threads than cores, libgomp stops spinning at barriers and
    sleeps instead, and every parallel region of the training thread pays a wake-up: training
    steps slow down while prefetch copies run (`benchmarks/bench_learner.py --model tiny`
    compares prefetch on and off). `torch.set_num_threads` would change the training thread
    too; OpenMP's own setting is per thread.
    """
    torch.get_num_threads()  # runs torch's lazy per-thread OpenMP setup now, so it cannot undo what follows
    for runtime in _openmp_runtimes():
        runtime.omp_set_num_threads(1)


class ThreadCopyEngine:
    """One background thread, FIFO. Used on CPU, where the 'device' is host memory too. The
    thread runs its copies without an OpenMP team (`serial_openmp_thread`)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clora-copy",
                                        initializer=serial_openmp_thread)
        self._last: Future | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> CopyHandle:
        with self._lock:
            self._last = self._pool.submit(job)
            return _FutureHandle(self._last)

    def drain(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _EventHandle:
    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class CudaStreamCopyEngine:
    """Jobs run on one side stream (FIFO by stream order), after the compute stream's pending work."""

    def __init__(self, device: torch.device):
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._last: torch.cuda.Event | None = None

    def submit(self, job: Callable[[], None]) -> CopyHandle:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            job()
            event = torch.cuda.Event()
            event.record(self._stream)
        self._last = event
        return _EventHandle(event)

    def drain(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        self.drain()


def make_copy_engine(device: torch.device, prefetch: bool) -> CopyEngine:
    if not prefetch:
        return SyncCopyEngine()
    if device.type == "cuda":
        return CudaStreamCopyEngine(device)
    return ThreadCopyEngine()

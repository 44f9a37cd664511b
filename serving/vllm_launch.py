"""How clora changes vLLM inside every process of a replica: the API server, its EngineCore and
the worker, which vLLM's CPU platform always *spawns* (fresh interpreters, so patching the
parent is not enough).

`write_site_hook(dir)` writes a `sitecustomize.py` into `dir`; a replica started with
`PYTHONPATH=dir` runs it at interpreter start in each of its processes (spawned children
inherit the environment). The hook does not import vLLM itself: it waits for a module to be
imported and patches it right after the module has executed. Two patches, each off unless its
variable is set (`LocalReplica.env` sets them on a CPU build):

- `CLORA_VLLM_CPU_LORA_OPS=1`: clora's CPU LoRA ops (`clora.serving.vllm_cpu_lora`) replace
  those of `vllm.lora.punica_wrapper.punica_cpu`.
- `CLORA_VLLM_SHM_POLL_S=<seconds>`: how a reader of vLLM's shared-memory queues
  (`vllm.distributed.device_communicators.shm_broadcast.SpinCondition`) waits while it is in
  its busy window (1 s after its last read): blocked on the writer's ping between checks, at
  most that long, instead of yielding in a loop (`poll_shm_queues`). The EngineCore waits so on its worker for every step.
  On a GPU host that costs an idle core; on a CPU host it takes the core from the model or from
  whatever else runs there. Measured in `clora bench experiments` on 2 cores: the EngineCore
  used a third of a core while the engine served, taken from the learner beside it. The patch
  waits on the socket every write pings, with a timeout in case a ping is missed.
"""

from __future__ import annotations

import time
from pathlib import Path

_ZMQ_NOBLOCK = 1
"""`zmq.NOBLOCK` (zmq is vLLM's dependency, not imported here)."""

HOOK = '''"""Written by clora.serving.vllm_launch: patch vLLM modules after they are imported."""
import importlib.abc
import os
import sys


def _lora_ops(module):
    from clora.serving.vllm_cpu_lora import install

    print(f"clora: CPU LoRA ops in pid {os.getpid()}:", ", ".join(install()), file=sys.stderr)


def _shm_poll(module):
    from clora.serving.vllm_launch import poll_shm_queues

    poll_s = float(os.environ["CLORA_VLLM_SHM_POLL_S"])
    if poll_shm_queues(module, poll_s):
        print(f"clora: shared-memory queue readers poll at most every {poll_s:g} s in pid {os.getpid()}", file=sys.stderr)


_PATCHES = {}
if os.environ.get("CLORA_VLLM_CPU_LORA_OPS") == "1":
    _PATCHES["vllm.lora.punica_wrapper.punica_cpu"] = _lora_ops
if os.environ.get("CLORA_VLLM_SHM_POLL_S"):
    _PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _shm_poll


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _PatchAfterImport())
'''


def poll_shm_queues(module, poll_s: float) -> bool:
    """Make every reader of `module.SpinCondition` (vLLM's `shm_broadcast`) block between checks
    of its queue during its busy window, where vLLM yields and checks again at once. It waits on
    the notify socket the writer pings after every write, so it wakes as the data arrives, but
    for at most an eighth of the time since its last read, from 1 ms up to `poll_s`: the socket
    can miss a ping (vLLM's own idle wait, used at once after a read, made a decode step take
    about 2 s), and the timeout bounds what a missed one costs. A long wait (the EngineCore's,
    for a step) wakes a few times, a short one (the worker's, for the next step) at once.
    Sleeping instead of the socket (an eighth of the wait, 50 us to 2 ms) overshot each wait:
    8 mixed adapters served 142-146 tok/s against 149-157 with vLLM's loop (`bench_serving`); a
    fixed 0.2 ms sleep woke the EngineCore 5,000 times a second and cost the base model 15%.
    Past the window, vLLM's own wait is unchanged. Returns False (and changes nothing) when the
    module has no such class: a vLLM this was not written for."""
    cls = getattr(module, "SpinCondition", None)
    if cls is None or getattr(cls.wait, "clora_poll_s", None) is not None:
        return cls is not None
    wait = cls.wait

    def polling_wait(self, timeout_ms: int | None = None) -> None:
        waited = time.monotonic() - self.last_read if getattr(self, "is_reader", False) else float("inf")
        if waited <= self.busy_loop_s:
            pause = min(poll_s, max(waited / 8, 1e-3))
            poller = getattr(self, "poller", None)
            if poller is None:                  # a class without vLLM's poller (tests' stand-in): sleep
                time.sleep(pause)
                return
            events = dict(poller.poll(timeout=max(1, round(pause * 1000))))   # in ms
            if self.local_notify_socket in events:   # a ping (or one left from a read in the window)
                self.local_notify_socket.recv(flags=_ZMQ_NOBLOCK, copy=False)
            return
        wait(self, timeout_ms)

    polling_wait.clora_poll_s = poll_s
    cls.wait = polling_wait
    return True


def write_site_hook(folder: Path | str) -> Path:
    """Write the hook into `folder` (put it on the replica's PYTHONPATH); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder

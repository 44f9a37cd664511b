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
- `CLORA_VLLM_SHM_SPIN_S=<seconds>`: how long a reader of vLLM's shared-memory queues
  (`vllm.distributed.device_communicators.shm_broadcast.SpinCondition`) spins after its last
  read before it sleeps on the socket every write pings (`limit_shm_spin`). vLLM spins for 1 s:
  the EngineCore yields in a loop while its worker runs each step. On a GPU host that costs an
  idle core; on a CPU host it takes the core from the model or from whatever else runs there.
  Measured in `clora bench experiments` on 2 cores: the spinning EngineCore used a third of a
  core while the engine served, taken from the learner beside it.
"""

from __future__ import annotations

from pathlib import Path

HOOK = '''"""Written by clora.serving.vllm_launch: patch vLLM modules after they are imported."""
import importlib.abc
import os
import sys


def _lora_ops(module):
    from clora.serving.vllm_cpu_lora import install

    print(f"clora: CPU LoRA ops in pid {os.getpid()}:", ", ".join(install()), file=sys.stderr)


def _shm_spin(module):
    from clora.serving.vllm_launch import limit_shm_spin

    spin_s = float(os.environ["CLORA_VLLM_SHM_SPIN_S"])
    if limit_shm_spin(module, spin_s):
        print(f"clora: shared-memory queue readers spin {spin_s:g} s in pid {os.getpid()}", file=sys.stderr)


_PATCHES = {}
if os.environ.get("CLORA_VLLM_CPU_LORA_OPS") == "1":
    _PATCHES["vllm.lora.punica_wrapper.punica_cpu"] = _lora_ops
if os.environ.get("CLORA_VLLM_SHM_SPIN_S"):
    _PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _shm_spin


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


def limit_shm_spin(module, spin_s: float) -> bool:
    """Make every reader `module.SpinCondition` creates (vLLM's `shm_broadcast`) spin `spin_s`
    seconds after its last read instead of vLLM's `busy_loop_s` (1 s), then wait on its notify
    socket: the writer pings it on every write, so a sleeping reader wakes for the next message.
    Returns False (and changes nothing) when the module has no such class: a vLLM this was not
    written against. A reader without `busy_loop_s` is left as it is."""
    cls = getattr(module, "SpinCondition", None)
    if cls is None or getattr(cls.__init__, "clora_spin_s", None) is not None:
        return cls is not None
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = spin_s

    __init__.clora_spin_s = spin_s
    cls.__init__ = __init__
    return True


def write_site_hook(folder: Path | str) -> Path:
    """Write the hook into `folder` (put it on the replica's PYTHONPATH); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder

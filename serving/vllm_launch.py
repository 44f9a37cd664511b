"""How clora's CPU LoRA ops (`clora.serving.vllm_cpu_lora`) get into every process of a vLLM
replica: the API server, its EngineCore and the worker, which vLLM's CPU platform always
*spawns* (fresh interpreters, so patching the parent is not enough).

`write_site_hook(dir)` writes a `sitecustomize.py` into `dir`; a replica started with
`PYTHONPATH=dir` and `CLORA_VLLM_CPU_LORA_OPS=1` runs it at interpreter start in each of its
processes (spawned children inherit the environment). The hook does not import vLLM itself:
it waits for `vllm.lora.punica_wrapper.punica_cpu` to be imported and patches the ops right
after that module has executed. Without the variable (or on a GPU build) vLLM runs unchanged.
"""

from __future__ import annotations

from pathlib import Path

HOOK = '''"""Written by clora.serving.vllm_launch: patch vLLM's CPU LoRA ops after they are imported."""
import importlib.abc
import os
import sys

_TARGET = "vllm.lora.punica_wrapper.punica_cpu"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
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
            from clora.serving.vllm_cpu_lora import install

            print(f"clora: CPU LoRA ops in pid {os.getpid()}:", ", ".join(install()), file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CLORA_VLLM_CPU_LORA_OPS") == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
'''


def write_site_hook(folder: Path | str) -> Path:
    """Write the hook into `folder` (put it on the replica's PYTHONPATH); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder

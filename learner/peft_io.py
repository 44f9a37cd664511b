"""Adapters on disk in PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

Both PEFT (`PeftModel.from_pretrained`) and vLLM (`--enable-lora`, `/v1/load_lora_adapter`)
load this layout unchanged. Keys are written exactly as PEFT writes them
(`base_model.model.<module path>.lora_A.weight`), and reading checks every expected key is
present, so a silent prefix mismatch (the base model served instead of the adapter) cannot
happen here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from clora.learner.lora import LoraLayout
from clora.storage import fsync_path  # noqa: F401 - re-exported: the learner's writers fsync through it

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterFormatError(RuntimeError):
    """An adapter folder is missing files or does not match the learner's layout."""


def adapter_config(layout: LoraLayout, base_model: str) -> dict:
    spec = layout.spec
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter(folder: Path, layout: LoraLayout, flat: torch.Tensor, base_model: str) -> None:
    """Write the two PEFT files into an existing `folder` and fsync them (the caller renames
    the folder into place; see publish.py)."""
    folder = Path(folder)
    save_file(layout.peft_state_dict(flat), folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(layout, base_model), indent=2))
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        fsync_path(folder / name)


def read_adapter(folder: Path, layout: LoraLayout) -> torch.Tensor:
    """The flat fp32 weight vector (layout.numel,) of the adapter stored in `folder`."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        tensors = load_file(folder / WEIGHTS_FILE)
    except (OSError, ValueError, SafetensorError) as e:   # missing, unreadable, not JSON, not safetensors
        raise AdapterFormatError(f"reading adapter from {folder} failed") from e
    spec = layout.spec
    if cfg.get("r") != spec.rank or float(cfg.get("lora_alpha", -1)) != spec.alpha:
        raise AdapterFormatError(f"adapter in {folder} has r={cfg.get('r')} alpha={cfg.get('lora_alpha')}, "
                                 f"learner expects r={spec.rank} alpha={spec.alpha}")
    try:
        return layout.flat_from_peft(tensors)
    except (KeyError, ValueError) as e:
        raise AdapterFormatError(f"adapter in {folder} does not match the base model's LoRA layout") from e

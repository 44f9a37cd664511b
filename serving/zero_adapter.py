"""A rank-1 all-zero LoRA adapter for the base model, served in place of "no adapter".

Why: vLLM's CPU LoRA ops (`vllm/lora/ops/torch_ops/lora_ops.py`, used by
`PunicaWrapperCPU`) select each row's weights with `lora_weights[lora_indices]`, and a
base-model row has index -1, which Python indexing turns into the *last* LoRA slot. Once
`--max-loras` adapters have been active, base-model rows batched together with adapter rows
silently get the adapter in slot `max_loras - 1` applied (found by the mixed-batch test).
Routing base-model requests to this zero adapter means no row ever carries index -1, and
its output is exactly the base model's. The GPU build's Triton kernels skip -1 rows, so
there it is off by default (`EngineSettings.base_via_zero_adapter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ZERO_ADAPTER_NAME = "__base__"


class ZeroAdapterError(RuntimeError):
    """The base model's config does not say how to shape a q_proj adapter."""


def write_zero_adapter(model_dir: Path | str, out: Path | str) -> Path:
    """Write a PEFT adapter (q_proj of every layer, rank 1, all zeros) for the model in `model_dir`."""
    model_dir, out = Path(model_dir), Path(out)
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    except (OSError, KeyError, ValueError) as e:
        raise ZeroAdapterError(f"cannot read hidden size / layers / heads from {model_dir}/config.json") from e
    head_dim = cfg.get("head_dim") or hidden // heads
    tensors = {}
    for i in range(layers):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(1, hidden)           # (rank, in)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(heads * head_dim, 1)  # (out, rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": 1, "lora_alpha": 1, "lora_dropout": 0.0, "target_modules": ["q_proj"], "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }))
    return out

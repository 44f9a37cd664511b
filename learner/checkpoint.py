"""Per-tenant checkpoints of the full training state, written atomically.

One file per tenant, `<checkpoints_dir>/<tenant>.safetensors`: tensors `buffer` (4, P) and
`rng_state`, and every scalar of `AdapterState` (step, cursor, examples seen, ...) as JSON
in the safetensors metadata; its publishing lineage (`last_published_version`,
`feedback_window`, the next version's feedback events `lineage`, each only when set) and its
reward baseline (`reward_baseline`, when set) sit in that JSON's `extras` object. Written to a
temporary name, fsynced, then `os.replace`d: a crash leaves the previous checkpoint or the
new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from clora.freshness import VersionLineage
from clora.learner.adapter_store import AdapterState
from clora.learner.peft_io import fsync_path

SUFFIX = ".safetensors"


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(root: Path | str, tenant: str) -> Path:
    return Path(root) / f"{tenant}{SUFFIX}"


def save_checkpoint(root: Path | str, state: AdapterState, layout_numel: int) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, state.tenant)
    tmp = root / f".tmp-{state.tenant}-{uuid.uuid4().hex[:8]}{SUFFIX}"
    meta = {"tenant": state.tenant, "seed": state.seed, "step": state.step, "micro_steps": state.micro_steps,
            "examples_seen": state.examples_seen, "cursor": state.cursor, "numel": layout_numel,
            "extras": _lineage(state)}
    try:
        save_file({"buffer": state.buffer.contiguous(), "rng_state": state.rng_state},
                  tmp, metadata={"clora_state": json.dumps(meta)})
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(root)  # the rename itself survives a power loss only once its folder is synced
    except (OSError, TypeError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"checkpointing {state.tenant} (step {state.step}) to {final} failed") from e
    return final


def load_checkpoint(path: Path | str, layout_numel: int) -> AdapterState:
    path = Path(path)
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["clora_state"])
        tensors = load_file(path)
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"reading checkpoint {path} failed") from e
    if meta["numel"] != layout_numel:
        raise CheckpointError(f"checkpoint {path} holds {meta['numel']} LoRA parameters, the learner's layout "
                              f"has {layout_numel} (rank/targets/base model changed?)")
    window = meta["extras"].get("feedback_window")
    lineage = meta["extras"].get("lineage")
    return AdapterState(tenant=meta["tenant"], seed=meta["seed"], buffer=tensors["buffer"],
                        rng_state=tensors["rng_state"], step=meta["step"], micro_steps=meta["micro_steps"],
                        examples_seen=meta["examples_seen"], cursor=meta["cursor"],
                        last_published_version=meta["extras"].get("last_published_version"),
                        feedback_window=tuple(window) if window else None,
                        lineage=VersionLineage.model_validate(lineage) if lineage is not None else None,
                        reward_baseline=meta["extras"].get("reward_baseline"))


def _lineage(state: AdapterState) -> dict:
    """The `extras` JSON object: `{"last_published_version": 3, "feedback_window": [t0, t1],
    "lineage": {"accepted_at": {"fb-1": t0}, "over_cap": 0}, "reward_baseline": 0.6}`, each key
    only when set."""
    out: dict = {}
    if state.last_published_version is not None:
        out["last_published_version"] = state.last_published_version
    if state.feedback_window is not None:
        out["feedback_window"] = list(state.feedback_window)
    if state.lineage is not None:
        out["lineage"] = state.lineage.model_dump()
    if state.reward_baseline is not None:
        out["reward_baseline"] = state.reward_baseline
    return out


def list_checkpoints(root: Path | str) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-"))


def remove_partial(root: Path | str) -> list[Path]:
    """Delete the temporary files of checkpoints a crash interrupted (each the size of a whole
    checkpoint: left alone they would fill the disk). Returns them."""
    root = Path(root)
    if not root.is_dir():
        return []
    partial = sorted(root.glob(f".tmp-*{SUFFIX}"))
    for p in partial:
        p.unlink(missing_ok=True)
    return partial

"""Per-tenant checkpoints of the full training state: the file format, and `Checkpoints`, which
keeps them in a `clora.checkpoint_storage.CheckpointStorage` under the writer's fencing token.

One file per checkpoint: tensors `buffer` (4, P) and `rng_state`, and every scalar of
`AdapterState` (step, cursor, examples seen, ...) as JSON in the safetensors metadata, with the
fencing token it was written under (`token`; 0 without leases); its publishing lineage
(`last_published_version`, `feedback_window`, the next version's feedback events `lineage`,
each only when set) and its reward baseline (`reward_baseline`, when set) sit in that JSON's
`extras` object.

`Checkpoints` stores a tenant as `tenants/<tenant>` and a Tinker run as `tinker/<run>`: the
storage keeps entries ordered by token, refuses a stale token (`FencedOut`) and writes
atomically (a crash leaves the previous checkpoint or the new one, never a torn file), in a
local folder or, across hosts, the S3 store, so that the learner that takes a tenant over reads
the last checkpoint wherever it was written. `save_checkpoint`/`load_checkpoint` read and write
one file in a folder (`<root>/<tenant>.safetensors`; the Tinker API's saved states use them).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from clora.checkpoint_storage import CheckpointEntry, CheckpointStorage
from clora.freshness import VersionLineage
from clora.storage import StorageError, StorageIntegrityError
from clora.learner.adapter_store import AdapterState
from clora.learner.peft_io import fsync_path

SUFFIX = ".safetensors"


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(root: Path | str, tenant: str) -> Path:
    return Path(root) / f"{tenant}{SUFFIX}"


def tenant_checkpoint(tenant: str) -> str:
    """The checkpoint name of a tenant: `tenants/acme`."""
    return f"tenants/{tenant}"


def run_checkpoint(run: str) -> str:
    """The checkpoint name of a Tinker run (its file-safe name): `tinker/acme--9f3c...`."""
    return f"tinker/{run}"


def write_checkpoint(path: Path, state: AdapterState, layout_numel: int, token: int = 0) -> None:
    """Write `state` to the file `path` (a temporary name: the caller moves it into place) and
    fsync it."""
    meta = {"tenant": state.tenant, "seed": state.seed, "step": state.step, "micro_steps": state.micro_steps,
            "examples_seen": state.examples_seen, "cursor": state.cursor, "numel": layout_numel, "token": token,
            "extras": _lineage(state)}
    save_file({"buffer": state.buffer.contiguous(), "rng_state": state.rng_state},
              path, metadata={"clora_state": json.dumps(meta)})
    fsync_path(path)


def save_checkpoint(root: Path | str, state: AdapterState, layout_numel: int) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, state.tenant)
    tmp = root / f".tmp-{state.tenant}-{uuid.uuid4().hex[:8]}{SUFFIX}"
    try:
        write_checkpoint(tmp, state, layout_numel)
        os.replace(tmp, final)
        fsync_path(root)  # the rename itself survives a power loss only once its folder is synced
    except (OSError, TypeError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"checkpointing {state.tenant} (step {state.step}) to {final} failed") from e
    return final


def load_checkpoint(path: Path | str, layout_numel: int, token: int | None = None) -> AdapterState:
    """The state in checkpoint file `path`; with `token`, `CheckpointError` unless it was written
    under that token (a file stored under another entry's name is not this entry)."""
    path = Path(path)
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["clora_state"])
        tensors = load_file(path)
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"reading checkpoint {path} failed") from e
    if token is not None and meta.get("token", 0) != token:
        raise CheckpointError(f"checkpoint {path} was written under token {meta.get('token', 0)}, its entry says "
                              f"{token}")
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


class Checkpoints:
    """Checkpoints by name (`tenant_checkpoint`, `run_checkpoint`) in `storage`, each written
    under the writer's fencing token. Example: `save("tenants/acme", state, token=17)`, then any
    learner's `load("tenants/acme")` returns that state until a later save."""

    def __init__(self, storage: CheckpointStorage, layout_numel: int):
        self.storage = storage
        self.numel = layout_numel

    def save(self, name: str, state: AdapterState, token: int) -> CheckpointEntry:
        """Store `state` as `name`'s newest checkpoint. `FencedOut` when a larger token wrote it;
        `CheckpointError` when it could not be written (the previous one stands)."""
        tmp = self.storage.staging()
        try:
            write_checkpoint(tmp, state, self.numel, token)
            return self.storage.put(name, token, tmp)
        except (OSError, TypeError, ValueError, StorageError) as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"checkpointing {name} (step {state.step}, token {token}) failed") from e

    def load(self, name: str) -> AdapterState | None:
        """`name`'s newest checkpoint, None when it has none (`CheckpointError` when unreadable).
        An entry gone between listing and reading (a stale holder's late write trims older
        entries) is looked for again, once."""
        try:
            try:
                return self._read_newest(name)
            except StorageIntegrityError:
                return self._read_newest(name)
        except StorageError as e:
            raise CheckpointError(f"reading {name}'s checkpoint failed") from e

    def _read_newest(self, name: str) -> AdapterState | None:
        entry = self.storage.newest(name)
        if entry is None:
            return None
        with self.storage.open(entry) as path:
            return load_checkpoint(path, self.numel, None if entry.legacy else entry.token)

"""Saved Tinker weights on disk: `tinker://` paths, their folders, and writing them atomically.

A path names a model and a checkpoint (docs/tinker-protocol.md §4.4):

    tinker://<model_id>/weights/<name>            training state: adapter + Adam state (resumable)
    tinker://<model_id>/sampler_weights/<name>    the adapter alone, as PEFT (what serving loads)

and lives at `<checkpoints_dir>/<tenant>/<model_id>/<kind>/<name>/`. The tenant is the one whose
key asks, never read from the path: another tenant's path resolves into the asker's own folder,
where it does not exist, so it is answered as unknown (404), as another tenant's model id is.
Ownership is on disk, so it survives the service forgetting its models on a restart.

Each folder holds `adapter_config.json` + `adapter_model.safetensors` (`clora.learner.peft_io`,
the format the learner's `Publisher` publishes), `tinker_checkpoint.json` (`CheckpointInfo`),
and for `weights` also `state.safetensors` (the run's whole `AdapterState`, in the learner's
checkpoint format, `clora.learner.checkpoint`). A checkpoint is written under
`.tmp-<name>-<random>` beside its final name, fsynced, then renamed: a reader sees a complete
checkpoint or none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from clora.learner.peft_io import fsync_path
from clora.trainapi.wire import WireError

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
INFO_FILE = "tinker_checkpoint.json"
SCHEME = "tinker://"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""A checkpoint name: one path component, no leading dot (temporary folders start with one)."""
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9:._-]{0,199}")


@dataclass(frozen=True)
class TinkerPath:
    """A parsed path. Example: "tinker://9f..:train:0/weights/step-2" ->
    TinkerPath(model_id="9f..:train:0", kind="weights", name="step-2")."""

    model_id: str
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"


def check_name(name: str, field: str = "path") -> str:
    if not _NAME.fullmatch(name):
        raise WireError(field, f"checkpoint name {name!r} must be 1-128 characters of letters, digits, '.', '_' "
                               "or '-', not starting with '.'")
    return name


def parse_path(path: str, field: str = "path") -> TinkerPath:
    """`tinker://<model_id>/<kind>/<name>`, each part checked; `WireError` naming `field` else."""
    if not path.startswith(SCHEME):
        raise WireError(field, f"{path!r} is not a tinker:// path (tinker://<model_id>/weights/<name>)")
    parts = path[len(SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.fullmatch(parts[0]):
        raise WireError(field, f"{path!r} is not tinker://<model_id>/weights/<name> or "
                               "tinker://<model_id>/sampler_weights/<name>")
    return TinkerPath(parts[0], parts[1], check_name(parts[2], field))


@dataclass(frozen=True)
class CheckpointInfo:
    """`tinker_checkpoint.json`: what `weights_info` answers and `load_weights` checks."""

    path: str
    tenant: str
    base_model: str
    lora_rank: int
    train_attn: bool
    train_mlp: bool
    step: int
    """The run's optimizer steps when it was saved."""
    has_optimizer: bool
    created_at: float


class NotFound(LookupError):
    """No such checkpoint for this tenant (or another tenant's): answered 404."""


class CheckpointDir:
    """The checkpoint folders under `root`, per tenant."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def folder(self, tenant: str, p: TinkerPath) -> Path:
        return self.root / tenant / p.model_id / p.kind / p.name

    def find(self, tenant: str, p: TinkerPath, field: str = "path") -> tuple[Path, CheckpointInfo]:
        """The folder and info of `tenant`'s checkpoint `p`; `NotFound` when it has none."""
        folder = self.folder(tenant, p)
        try:
            info = CheckpointInfo(**json.loads((folder / INFO_FILE).read_text()))
        except FileNotFoundError:
            raise NotFound(f"{field}: no checkpoint {str(p)!r}") from None
        except (OSError, ValueError, TypeError) as e:
            raise OSError(f"reading checkpoint {folder} failed") from e
        return folder, info

    def write(self, tenant: str, p: TinkerPath, overwrite: bool, fill: Callable[[Path], CheckpointInfo]) -> Path:
        """Create checkpoint `p` atomically: `fill(tmp)` writes its files into a fresh temporary
        folder and returns its info; then the folder is fsynced and renamed into place. Without
        `overwrite` an existing checkpoint is a `FileExistsError` and stays as it was."""
        final = self.folder(tenant, p)
        parent = final.parent
        parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and not overwrite:
            raise FileExistsError(f"path: checkpoint {str(p)!r} exists; pass overwrite=True to replace it")
        tmp = parent / f".tmp-{p.name}-{uuid.uuid4().hex[:8]}"
        old = parent / f".old-{p.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            info = fill(tmp)
            (tmp / INFO_FILE).write_text(json.dumps(asdict(info), indent=2))
            for f in tmp.iterdir():
                fsync_path(f)
            fsync_path(tmp)
            if final.exists():   # overwrite: a rename cannot replace a folder, so move the old one aside
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_path(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():
                os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return final

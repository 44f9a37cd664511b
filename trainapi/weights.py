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

**With the S3 adapter store** (`CLORA_STORAGE_BACKEND=s3`) the store holds the checkpoints and
the folders are each host's cache, so the training API and the learners need no shared volume
(`RemoteCheckpoints`). A checkpoint is the objects
`<s3_checkpoint_prefix>/tinker-weights/<tenant>/<model_id>/<kind>/<name>/<write_id>/<file>`,
uploaded first, then `.../<name>/current.json` (`SavedManifest`: the write id, the
`CheckpointInfo` and each file's sha256), written last in one PUT: a checkpoint exists once its
`current.json` does, and an overwrite replaces it in that one PUT (the previous write's objects
are deleted after). A reader fetches the current write into its cache under a temporary name,
checks every digest and renames it into place; a cached copy of an older write is replaced.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from clora.ids import validate_tenant_id
from clora.storage import FileDigest, StorageError, StorageIntegrityError, StorageSettings, fsync_path, s3_call, \
    s3_client, s3_delete_prefix, sha256_file
from clora.trainapi.wire import WireError

log = logging.getLogger(__name__)

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
INFO_FILE = "tinker_checkpoint.json"
WRITE_FILE = ".write_id"
"""In a cached copy of a stored checkpoint: the write it holds (`SavedManifest.write_id`)."""
CURRENT = "current.json"
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


class SavedManifest(BaseModel):
    """A stored checkpoint's `current.json`. Example: `{"write_id": "5be0...", "info": {"path":
    "tinker://9f..:train:0/weights/two", ...}, "files": {"adapter_model.safetensors": {"sha256":
    "9f2c...", "size": 1310808}, ...}}`."""

    write_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    info: dict
    files: dict[str, FileDigest]

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, FileDigest]) -> dict[str, FileDigest]:
        for name in files:
            if not _NAME.fullmatch(name) or name in (INFO_FILE, WRITE_FILE):
                raise ValueError(f"file name {name!r} is not a plain checkpoint file name")
        return files

    def checkpoint_info(self) -> CheckpointInfo:
        return CheckpointInfo(**self.info)


class RemoteCheckpoints:
    """The checkpoints in the S3-compatible store `settings` names (see the module docstring)."""

    def __init__(self, settings: StorageSettings):
        self.bucket = settings.s3_bucket
        self.prefix = f"{settings.s3_checkpoint_prefix}/tinker-weights"
        self.client = s3_client(settings)

    def key(self, tenant: str, p: TinkerPath, *parts: str) -> str:
        return "/".join((self.prefix, tenant, p.model_id, p.kind, p.name, *parts))

    def current(self, tenant: str, p: TinkerPath) -> SavedManifest | None:
        """The checkpoint's current write; None when it has none (never saved, or torn before
        its `current.json`)."""
        key = self.key(tenant, p, CURRENT)
        what = f"reading s3://{self.bucket}/{key}"
        try:
            body = s3_call(what, self.client.get_object, Bucket=self.bucket, Key=key)
        except StorageIntegrityError:
            return None
        try:
            return SavedManifest.model_validate_json(s3_call(what, body["Body"].read))
        except ValidationError as e:
            raise StorageIntegrityError(f"s3://{self.bucket}/{key} is malformed") from e

    def put(self, tenant: str, p: TinkerPath, folder: Path, info: CheckpointInfo) -> SavedManifest:
        """Store the complete checkpoint `folder` as `p`'s current write (replacing any)."""
        before = self.current(tenant, p)
        write_id = uuid.uuid4().hex
        files = {f.name: FileDigest(sha256=sha256_file(f), size=f.stat().st_size)
                 for f in sorted(folder.iterdir()) if f.is_file() and f.name not in (INFO_FILE, WRITE_FILE)}
        for name in files:
            key = self.key(tenant, p, write_id, name)
            s3_call(f"uploading s3://{self.bucket}/{key}", self.client.upload_file, str(folder / name), self.bucket, key)
        manifest = SavedManifest(write_id=write_id, info=asdict(info), files=files)
        key = self.key(tenant, p, CURRENT)
        s3_call(f"writing s3://{self.bucket}/{key}", self.client.put_object, Bucket=self.bucket, Key=key,
                Body=manifest.model_dump_json().encode())     # last: from now on this write is the checkpoint
        if before is not None:
            self.delete_write(tenant, p, before)
        return manifest

    def delete_write(self, tenant: str, p: TinkerPath, m: SavedManifest) -> None:
        """Delete a write that is no longer current (failures are logged: only space is lost)."""
        keys = [{"Key": self.key(tenant, p, m.write_id, name)} for name in m.files]
        try:
            s3_call(f"deleting {p}'s previous write", self.client.delete_objects, Bucket=self.bucket,
                    Delete={"Objects": keys, "Quiet": True})
        except StorageIntegrityError:
            pass
        except Exception:  # noqa: BLE001 - the checkpoint is stored; an orphan write costs space only
            log.exception("deleting the previous write %s of %s failed", m.write_id, p)

    def delete_tenant(self, tenant: str) -> int:
        """Delete every object of `tenant`'s checkpoints (a deleted tenant); returns how many."""
        return s3_delete_prefix(self.client, self.bucket, "/".join((self.prefix, tenant, "")))

    def fetch(self, tenant: str, p: TinkerPath, m: SavedManifest, folder: Path) -> None:
        """Download write `m` into the new folder `folder` and check every file against it."""
        folder.mkdir(parents=True)
        for name, want in m.files.items():
            key = self.key(tenant, p, m.write_id, name)
            s3_call(f"downloading s3://{self.bucket}/{key}", self.client.download_file, self.bucket, key,
                    str(folder / name))
            got = folder / name
            if got.stat().st_size != want.size or sha256_file(got) != want.sha256:
                raise StorageIntegrityError(f"{p}: {name} does not match its digest in {CURRENT}")
        (folder / INFO_FILE).write_text(json.dumps(m.info, indent=2))
        (folder / WRITE_FILE).write_text(m.write_id)


class CheckpointDir:
    """The checkpoint folders under `root`, per tenant; with `storage` naming an S3 store, the
    store holds them and the folders are this host's cache of them."""

    def __init__(self, root: Path | str, storage: StorageSettings | None = None):
        self.root = Path(root)
        self.remote = RemoteCheckpoints(storage) if storage is not None and storage.backend == "s3" else None

    def folder(self, tenant: str, p: TinkerPath) -> Path:
        return self.root / tenant / p.model_id / p.kind / p.name

    def exists(self, tenant: str, p: TinkerPath) -> bool:
        if self.remote is not None:
            return self.remote.current(tenant, p) is not None
        return self.folder(tenant, p).exists()

    def info(self, tenant: str, p: TinkerPath, field: str = "path") -> CheckpointInfo:
        """The info of `tenant`'s checkpoint `p` (without fetching it); `NotFound` when it has none."""
        if self.remote is None:
            return self.find(tenant, p, field)[1]
        m = self.remote.current(tenant, p)
        if m is None:
            raise NotFound(f"{field}: no checkpoint {str(p)!r}")
        return m.checkpoint_info()

    def find(self, tenant: str, p: TinkerPath, field: str = "path") -> tuple[Path, CheckpointInfo]:
        """The folder and info of `tenant`'s checkpoint `p`; `NotFound` when it has none."""
        if self.remote is not None:
            return self._fetch(tenant, p, field)
        folder = self.folder(tenant, p)
        try:
            info = CheckpointInfo(**json.loads((folder / INFO_FILE).read_text()))
        except FileNotFoundError:
            raise NotFound(f"{field}: no checkpoint {str(p)!r}") from None
        except (OSError, ValueError, TypeError) as e:
            raise OSError(f"reading checkpoint {folder} failed") from e
        return folder, info

    def _fetch(self, tenant: str, p: TinkerPath, field: str) -> tuple[Path, CheckpointInfo]:
        """The store's current write of `p`, from this host's cache when it holds that write
        intact, else fetched into it."""
        m = self.remote.current(tenant, p)
        if m is None:
            raise NotFound(f"{field}: no checkpoint {str(p)!r}")
        final = self.folder(tenant, p)
        if _holds(final, m):
            return final, m.checkpoint_info()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-fetch-{p.name}-{uuid.uuid4().hex[:8]}"
        try:
            self.remote.fetch(tenant, p, m, tmp)
            _replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, m.checkpoint_info()

    def delete_tenant(self, tenant: str) -> None:
        """Delete every checkpoint of `tenant` (a deleted tenant): its folder here and, with a
        store, its objects there. Safe to repeat."""
        validate_tenant_id(tenant)     # one path component: never a parent, never the root
        if self.remote is not None:
            self.remote.delete_tenant(tenant)
        try:
            shutil.rmtree(self.root / tenant)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"deleting {self.root / tenant} failed") from e

    def write(self, tenant: str, p: TinkerPath, overwrite: bool, fill: Callable[[Path], CheckpointInfo]) -> Path:
        """Create checkpoint `p` atomically: `fill(tmp)` writes its files into a fresh temporary
        folder and returns its info; then the folder is fsynced and renamed into place (and, with
        a store, uploaded, its `current.json` last). Without `overwrite` an existing checkpoint is
        a `FileExistsError` and stays as it was."""
        if not overwrite and self.exists(tenant, p):
            raise FileExistsError(f"path: checkpoint {str(p)!r} exists; pass overwrite=True to replace it")
        final = self.folder(tenant, p)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{p.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            info = fill(tmp)
            (tmp / INFO_FILE).write_text(json.dumps(asdict(info), indent=2))
            if self.remote is not None:
                (tmp / WRITE_FILE).write_text(self.remote.put(tenant, p, tmp, info).write_id)
            for f in tmp.iterdir():
                fsync_path(f)
            fsync_path(tmp)
            _replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


def _holds(folder: Path, m: SavedManifest) -> bool:
    """Whether the cached `folder` is write `m`, every file intact."""
    try:
        if (folder / WRITE_FILE).read_text() != m.write_id:
            return False
        return all((folder / n).stat().st_size == d.size and sha256_file(folder / n) == d.sha256
                   for n, d in m.files.items())
    except OSError:
        return False


def _replace(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`; an existing `final` is moved aside first (a
    rename cannot replace a folder) and deleted after, or put back if the rename fails."""
    old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
    moved = False
    if final.exists():
        os.rename(final, old)
        moved = True
    try:
        os.rename(tmp, final)
    except BaseException:
        if moved and not final.exists():
            os.rename(old, final)
        raise
    fsync_path(final.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)

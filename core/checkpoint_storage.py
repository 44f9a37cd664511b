"""Where learners keep training-state checkpoints: `CheckpointStorage`, a local folder or the
S3-compatible adapter store (`StorageSettings.backend`), with entries ordered and fenced by the
writer's lease token (`clora.fencing`).

A checkpoint is one file in the learner's format (`clora.learner.checkpoint`), stored as an
*entry* of a name: `tenants/<tenant>` for a tenant, `tinker/<run>` for a Tinker run. Entries are
never overwritten. Each is its own file or object, named by the writer's fencing token and a
sequence number within that token: `t000000000017-n000000004.safetensors`, so names sort as
(token, seq). The newest entry is the one with the largest (token, seq), whenever it was written.

- **Fenced.** `put` refuses (`FencedOut`) a token smaller than the newest entry's: a learner
  that lost a tenant's lease cannot overwrite or outrank the state of the learner that took the
  tenant over. A stale write that lands between that learner's last look and its first write
  only adds an entry with a smaller token, which the newer holder's next entry outranks.
- **Atomic.** Local: the file is written under a temporary name, fsynced and renamed into place
  (then its folder is fsynced). S3: one PUT (a multipart upload is invisible until complete),
  with the file's sha256 in the object's metadata; `open` downloads it under a temporary name
  and checks the digest before anyone reads it (`StorageIntegrityError` on a mismatch).
- **Trimmed.** After each `put`, older entries of the name beyond `KEEP` are deleted.

Layout: local `<root>/<space>/<id>/<entry>` (and, read only, the single-file layout from before
entries, `<root>/<tenant>.safetensors` and `<root>/tinker/<run>.safetensors`, as token 0,
seq 0); S3 `<s3_checkpoint_prefix>/<space>/<id>/<entry>`, with `root` a local folder for files
on their way in and out.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clora.fencing import FencedOut
from clora.storage import StorageError, StorageIntegrityError, StorageSettings, s3_call, s3_client, s3_delete_prefix, \
    sha256_file

log = logging.getLogger(__name__)

KEEP = 2
"""Entries kept per name: the newest and the one before it."""
NAME = re.compile(r"(?P<space>[a-z]+)/(?P<id>[A-Za-z0-9_][A-Za-z0-9_.-]{0,200})")
ENTRY = re.compile(r"t(?P<token>[0-9]{12})-n(?P<seq>[0-9]{9})\.safetensors")
SUFFIX = ".safetensors"


@dataclass(frozen=True, order=True)
class CheckpointEntry:
    """One stored checkpoint of `name`. Example: the 4th checkpoint learner token 17 wrote of
    tenant acme: `CheckpointEntry(token=17, seq=4, name="tenants/acme")`, file
    `t000000000017-n000000004.safetensors`. Entries order by (token, seq)."""

    token: int
    seq: int
    name: str

    @property
    def file(self) -> str:
        return f"t{self.token:012d}-n{self.seq:09d}{SUFFIX}"

    @property
    def legacy(self) -> bool:
        """The single-file layout from before entries (read, then trimmed)."""
        return self.seq == 0


class CheckpointStorage(Protocol):
    """Checkpoints by name, newest first. Example: `put("tenants/acme", 17, file)` stores `file`
    as `CheckpointEntry(17, 1, "tenants/acme")` when token 17 had written none before;
    `newest("tenants/acme")` then returns it, and `open` of it yields a local path to read."""

    root: Path
    """A local folder: the entries themselves (local), or files on their way in and out (S3).
    Files handed to `put` are written under it (`staging`)."""

    def staging(self) -> Path:
        """A fresh temporary path under `root` to write a file for `put` to."""
        ...

    def put(self, name: str, token: int, file: Path) -> CheckpointEntry:
        """Store `file` (moved or uploaded, then gone) as the newest entry of `name` under fencing
        token `token`. `FencedOut` (and `file` deleted) when an entry with a larger token exists."""
        ...

    def newest(self, name: str) -> CheckpointEntry | None:
        ...

    def entries(self, name: str) -> list[CheckpointEntry]:
        """Every entry of `name`, oldest first."""
        ...

    def open(self, entry: CheckpointEntry) -> contextlib.AbstractContextManager[Path]:
        """A local path holding `entry`'s file, verified, for the `with` block."""
        ...

    def delete(self, name: str) -> None:
        """Delete every entry of `name` (a deleted tenant's checkpoints; missing is no error)."""
        ...

    def clean_partial(self) -> list[Path]:
        """Delete temporary files a crash left under `root`; returns them."""
        ...


def open_checkpoint_storage(settings: StorageSettings, root: Path | str) -> CheckpointStorage:
    """Checkpoints where the adapter versions are: under the local folder `root`, or in the S3
    store (with `root` for files on their way)."""
    if settings.backend == "local":
        return LocalCheckpoints(root)
    return S3Checkpoints(settings, root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_name(name: str) -> tuple[str, str]:
    """(space, id) of a checkpoint name, or `ValueError`."""
    if not (m := NAME.fullmatch(name)):
        raise ValueError(f"{name[:200]!r} is not a checkpoint name (<space>/<id>)")
    return m["space"], m["id"]


def _parse(name: str, files: list[str]) -> list[CheckpointEntry]:
    return sorted(CheckpointEntry(int(m["token"]), int(m["seq"]), name) for f in files if (m := ENTRY.fullmatch(f)))


def _next(name: str, token: int, entries: list[CheckpointEntry]) -> CheckpointEntry:
    """The entry a `put` of `token` writes next, or `FencedOut` when a newer token wrote."""
    newest = entries[-1] if entries else None
    if newest is not None and newest.token > token:
        raise FencedOut(f"checkpoint {name}: token {newest.token} has written it, token {token} is stale")
    return CheckpointEntry(token, newest.seq + 1 if newest is not None and newest.token == token else 1, name)


class LocalCheckpoints:
    """Entries as files under `root` (one host, or a file system every learner mounts)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def _folder(self, name: str) -> Path:
        space, ident = check_name(name)
        return self.root / space / ident

    def _legacy(self, name: str) -> Path:
        space, ident = check_name(name)
        return (self.root if space == "tenants" else self.root / space) / f"{ident}{SUFFIX}"

    def _path(self, entry: CheckpointEntry) -> Path:
        return self._legacy(entry.name) if entry.legacy else self._folder(entry.name) / entry.file

    def entries(self, name: str) -> list[CheckpointEntry]:
        folder = self._folder(name)
        found = _parse(name, [p.name for p in folder.iterdir()]) if folder.is_dir() else []
        return ([CheckpointEntry(0, 0, name)] if self._legacy(name).is_file() else []) + found

    def staging(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".tmp-{uuid.uuid4().hex[:12]}{SUFFIX}"

    def put(self, name: str, token: int, file: Path) -> CheckpointEntry:
        entries = self.entries(name)
        try:
            entry = _next(name, token, entries)
            folder = self._folder(name)
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(file, folder / entry.file)
            _fsync(folder)    # the rename itself survives a power loss only once its folder is synced
        except BaseException:
            Path(file).unlink(missing_ok=True)
            raise
        for old in entries[:len(entries) - KEEP + 1]:
            self._path(old).unlink(missing_ok=True)
        return entry

    def newest(self, name: str) -> CheckpointEntry | None:
        entries = self.entries(name)
        return entries[-1] if entries else None

    @contextlib.contextmanager
    def open(self, entry: CheckpointEntry) -> Iterator[Path]:
        path = self._path(entry)
        if not path.is_file():
            raise StorageIntegrityError(f"checkpoint {path} is gone (trimmed by a newer writer?)")
        yield path

    def delete(self, name: str) -> None:
        folder = self._folder(name)
        for entry in self.entries(name):
            self._path(entry).unlink(missing_ok=True)
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"deleting checkpoints {folder} failed") from e

    def clean_partial(self) -> list[Path]:
        partial = sorted(self.root.rglob(f".tmp-*{SUFFIX}")) if self.root.is_dir() else []
        for p in partial:
            p.unlink(missing_ok=True)
        return partial


class S3Checkpoints:
    """Entries as objects in the adapter store's bucket, under `s3_checkpoint_prefix`."""

    def __init__(self, settings: StorageSettings, root: Path | str):
        if not settings.s3_bucket:
            raise ValueError("S3Checkpoints needs settings.s3_bucket")
        self.root = Path(root)
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_checkpoint_prefix
        self.client = s3_client(settings)

    def key(self, entry: CheckpointEntry) -> str:
        return f"{self.prefix}/{entry.name}/{entry.file}"

    def entries(self, name: str) -> list[CheckpointEntry]:
        check_name(name)
        prefix = f"{self.prefix}/{name}/"
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/")
        keys = s3_call(f"listing s3://{self.bucket}/{prefix}",
                       lambda: [o["Key"] for page in pages for o in page.get("Contents", [])])
        return _parse(name, [k[len(prefix):] for k in keys])

    def staging(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".tmp-{uuid.uuid4().hex[:12]}{SUFFIX}"

    def put(self, name: str, token: int, file: Path) -> CheckpointEntry:
        try:
            entries = self.entries(name)
            entry = _next(name, token, entries)
            s3_call(f"uploading s3://{self.bucket}/{self.key(entry)}", self.client.upload_file, str(file), self.bucket,
                    self.key(entry), ExtraArgs={"Metadata": {"sha256": sha256_file(Path(file))}})
        finally:
            Path(file).unlink(missing_ok=True)
        if old := entries[:len(entries) - KEEP + 1]:
            out = s3_call(f"trimming s3://{self.bucket}/{self.prefix}/{name}", self.client.delete_objects,
                          Bucket=self.bucket, Delete={"Objects": [{"Key": self.key(e)} for e in old], "Quiet": True})
            if out.get("Errors"):   # left for the next put to trim
                log.warning("trimming checkpoints of %s failed for %d objects: %s", name, len(out["Errors"]),
                            out["Errors"][0])
        return entry

    def newest(self, name: str) -> CheckpointEntry | None:
        entries = self.entries(name)
        return entries[-1] if entries else None

    @contextlib.contextmanager
    def open(self, entry: CheckpointEntry) -> Iterator[Path]:
        where = f"s3://{self.bucket}/{self.key(entry)}"
        tmp = self.staging()
        try:
            self._download(where, entry, tmp)
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)

    def _download(self, where: str, entry: CheckpointEntry, tmp: Path) -> None:
        """`entry`'s object into `tmp`, its sha256 checked against the object's metadata."""
        body = s3_call(f"reading {where}", self.client.get_object, Bucket=self.bucket, Key=self.key(entry))
        want = body.get("Metadata", {}).get("sha256")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                def copy() -> None:
                    for chunk in body["Body"].iter_chunks(1 << 20):
                        h.update(chunk)
                        f.write(chunk)
                s3_call(f"reading {where}", copy)
        except OSError as e:
            raise StorageError(f"downloading {where} to {tmp} failed") from e
        if want is None or h.hexdigest() != want:
            raise StorageIntegrityError(f"{where} has sha256 {h.hexdigest()[:12]}..., its metadata says "
                                        f"{(want or 'nothing')[:12]}...")

    def delete(self, name: str) -> None:
        check_name(name)
        s3_delete_prefix(self.client, self.bucket, f"{self.prefix}/{name}/")

    def clean_partial(self) -> list[Path]:
        partial = sorted(self.root.glob(f".tmp-*{SUFFIX}")) if self.root.is_dir() else []
        for p in partial:
            p.unlink(missing_ok=True)
        return partial

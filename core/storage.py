"""Where published adapter versions live: `AdapterStorage`, with a local folder and an
S3-compatible object store behind it, and `StorageSettings` (`CLORA_STORAGE_<FIELD>`).

A version is one folder, `<tenant>/v<N>/` (`adapter_config.json`, `adapter_model.safetensors`,
`clora_metadata.json`), named in the registry by its URI (`AdapterVersion.path`).

- `LocalStorage` (the embedded default): versions are folders under `root`, and a version's URI
  is its absolute path. `publish` renames a complete folder into place, `fetch` returns the path
  as it is.
- `S3Storage` (multi-host deployments; AWS S3, MinIO, Ceph, moto): a version is the objects
  `<prefix>/<tenant>/v<N>/<file>` plus `clora_manifest.json`, each file's sha256 and size,
  written LAST. Its URI is `s3://<bucket>/<prefix>/<tenant>/v<N>`. A version without a manifest
  (an upload torn by a crash) is no version: nothing fetches it, but its number stays taken
  (`versions` lists it), so it is never reused. `fetch` downloads into `root`, the host's cache
  (`<root>/<tenant>/v<N>/`), under a temporary name, checks every file against the manifest and
  only then renames the folder into place: a mismatch or a missing object raises
  `StorageIntegrityError` and leaves no folder. A cached folder is checked again on every fetch;
  a corrupt one is dropped and fetched again. `delete` removes the manifest first.

The caller orders the steps around the registry: publish here, then record the version there;
read the registry, then fetch here (`clora.learner.publish`, `clora.serving.engine`). Versions
are never overwritten: a folder or a prefix that exists already refuses a publish.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings

from clora.ids import TENANT_ID_RE
from clora.settings import settings_config

log = logging.getLogger(__name__)

MANIFEST_FILE = "clora_manifest.json"
VERSION_DIR = re.compile(r"v([0-9]+)")
"""A version folder's (or prefix's) name: `v<N>`."""
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_CHUNK = 1 << 20


class StorageError(RuntimeError):
    """The store could not be reached or refused a call (retrying later may succeed)."""


class StorageIntegrityError(StorageError):
    """A version is missing, torn, or does not match its manifest (retrying will not mend it)."""


class StorageSettings(BaseSettings):
    """Where adapter versions are stored. The learner and serving read the same settings."""

    model_config = settings_config("CLORA_STORAGE_")

    backend: Literal["local", "s3"] = "local"
    """`local`: versions are folders under the learner's `adapters_dir`, which vLLM reads as they
    are (one host, or a shared file system). `s3`: an S3-compatible object store."""
    cache_dir: Path = Path(".clora/adapter-cache")
    """With `s3`: where serving fetches versions to (vLLM loads them from here, so a vLLM on
    another host must see this folder at the same path). The learner caches in its `adapters_dir`."""
    s3_endpoint_url: str | None = None
    """`http://minio:9000` for MinIO or moto; unset for AWS S3."""
    s3_bucket: str | None = None
    """The bucket (it must exist); required with `s3`."""
    s3_prefix: str = "adapters"
    """Key prefix of every version: `<prefix>/<tenant>/v<N>/<file>` ("" for none)."""
    s3_checkpoint_prefix: str = "checkpoints"
    """Key prefix of the learners' training-state checkpoints with `s3`
    (`<prefix>/tenants/<tenant>/...`, `clora.checkpoint_storage`): apart from the versions."""
    s3_region: str | None = None
    """Unset: boto3's default (`AWS_REGION`, the config file)."""
    s3_access_key_id: str | None = None
    """Unset (with the secret): boto3's credential chain (`AWS_*` variables, an instance role)."""
    s3_secret_access_key: SecretStr | None = None
    s3_addressing_style: Literal["path", "virtual", "auto"] | None = None
    """Unset: `path` with an `s3_endpoint_url` (MinIO, moto), boto3's `auto` without."""
    s3_timeout_s: float = Field(default=60.0, gt=0)
    """Connect and read timeout of one call."""
    s3_max_attempts: int = Field(default=5, ge=1)
    """Attempts per call (boto3's standard retry mode, with back-off)."""

    @field_validator("s3_prefix", "s3_checkpoint_prefix")
    @classmethod
    def _strip_slashes(cls, v: str) -> str:
        return v.strip("/")

    @model_validator(mode="after")
    def _s3_complete(self) -> "StorageSettings":
        if self.backend == "s3" and not self.s3_bucket:
            raise ValueError("s3_bucket is required with backend s3")
        ckpt, versions = self.s3_checkpoint_prefix, self.s3_prefix
        if not ckpt or ckpt == versions or (versions and ckpt.startswith(versions + "/")) \
                or (versions and versions.startswith(ckpt + "/")):
            raise ValueError(f"s3_checkpoint_prefix {ckpt!r} must be set and apart from s3_prefix {versions!r}")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both s3_access_key_id and s3_secret_access_key, or neither")
        return self


class AdapterStorage(Protocol):
    """Published adapter versions. Example: `publish("acme", 3, folder)` returns
    `s3://adapters-bucket/adapters/acme/v3`; `fetch` of that returns `<root>/acme/v3`."""

    root: Path
    """The local folder where versions live (local) or are cached (s3): `<root>/<tenant>/v<N>/`."""

    def uri(self, tenant: str, version: int) -> str:
        """The name the registry records for a version (`AdapterVersion.path`)."""
        ...

    def publish(self, tenant: str, version: int, folder: Path) -> str:
        """Make the complete folder `folder` (on the same file system as `root`; it is moved to
        `<root>/<tenant>/v<N>`) version `version`, durably; returns its URI. Raises
        `StorageError` and leaves no version behind (a torn upload's number stays taken)."""
        ...

    def fetch(self, uri: str) -> Path:
        """A local folder holding the version `uri` names, verified. A URI that is a local path
        is returned as it is."""
        ...

    def versions(self, tenant: str) -> list[int]:
        """Every version number the store holds for `tenant`, torn ones included, ascending."""
        ...

    def delete(self, tenant: str, versions: Iterable[int]) -> None:
        """Delete versions (missing ones are no error)."""
        ...

    def delete_tenant(self, tenant: str) -> None:
        """Delete every version of `tenant` and its folder (a deleted tenant's; safe to repeat)."""
        ...


def open_storage(settings: StorageSettings, root: Path | str) -> AdapterStorage:
    """The storage `settings` describe, keeping versions (local) or caching them (s3) in `root`."""
    if settings.backend == "local":
        return LocalStorage(root)
    return S3Storage(settings, root)


def local_versions(folder: Path) -> list[int]:
    """The version numbers of the `v<N>` folders in `folder` (a tenant's), ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := VERSION_DIR.fullmatch(p.name)))


def _tenant_dir(tenant: str) -> str:
    """`tenant` as one folder name, or `ValueError` (never `..`, a slash or an empty name)."""
    if not TENANT_ID_RE.fullmatch(tenant):
        raise ValueError(f"{tenant[:100]!r} is not a tenant id")
    return tenant


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """Versions as folders under `root` (the learner's `adapters_dir`); a version's URI is its
    absolute path, which vLLM on the same host reads as it is."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def uri(self, tenant: str, version: int) -> str:
        return str((self.root / tenant / f"v{version}").resolve())

    def publish(self, tenant: str, version: int, folder: Path) -> str:
        final = self.root / tenant / f"v{version}"
        if final.exists():
            raise StorageError(f"version folder {final} already exists; versions are never overwritten")
        os.rename(folder, final)
        fsync_path(final.parent)
        return self.uri(tenant, version)

    def fetch(self, uri: str) -> Path:
        return Path(uri)

    def versions(self, tenant: str) -> list[int]:
        return local_versions(self.root / tenant)

    def delete(self, tenant: str, versions: Iterable[int]) -> None:
        for n in versions:
            shutil.rmtree(self.root / tenant / f"v{n}", ignore_errors=True)

    def delete_tenant(self, tenant: str) -> None:
        folder = self.root / _tenant_dir(tenant)
        self.delete(tenant, self.versions(tenant))   # versions first: a crash midway leaves no half version
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"deleting {folder} failed") from e


class FileDigest(BaseModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class Manifest(BaseModel):
    """`clora_manifest.json`: what a complete version holds. Example: `{"tenant": "acme",
    "version": 3, "files": {"adapter_config.json": {"sha256": "9f2c...", "size": 612}, ...}}`."""

    tenant: str
    version: int = Field(ge=0)
    files: dict[str, FileDigest]

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, FileDigest]) -> dict[str, FileDigest]:
        for name in files:   # a manifest names files inside the version folder, nothing else
            if not _FILE_NAME.fullmatch(name) or name == MANIFEST_FILE:
                raise ValueError(f"file name {name!r} is not a plain file name")
        return files

    @classmethod
    def of(cls, tenant: str, version: int, folder: Path) -> "Manifest":
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        return cls(tenant=tenant, version=version,
                   files={p.name: FileDigest(sha256=sha256_file(p), size=p.stat().st_size) for p in files})

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Manifest":
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            raise StorageIntegrityError(f"the manifest of {where} is malformed") from e

    def check(self, folder: Path, where: str) -> None:
        """Raise `StorageIntegrityError` unless every file in `folder` matches its digest."""
        for name, want in self.files.items():
            path = folder / name
            if not path.is_file():
                raise StorageIntegrityError(f"{where}: {name} is missing")
            size = path.stat().st_size
            if size != want.size:
                raise StorageIntegrityError(f"{where}: {name} has {size} bytes, the manifest says {want.size}")
            if (got := sha256_file(path)) != want.sha256:
                raise StorageIntegrityError(f"{where}: {name} has sha256 {got[:12]}..., the manifest says "
                                            f"{want.sha256[:12]}...")


def s3_client(settings: StorageSettings):
    """A boto3 S3 client for the store `settings` describe (imported here: a local deployment
    never imports boto3)."""
    import boto3
    from botocore.config import Config

    style = settings.s3_addressing_style or ("path" if settings.s3_endpoint_url else "auto")
    secret = settings.s3_secret_access_key
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=secret.get_secret_value() if secret is not None else None,
        config=Config(s3={"addressing_style": style}, connect_timeout=settings.s3_timeout_s,
                      read_timeout=settings.s3_timeout_s,
                      retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"}))


def s3_call(what: str, fn, *args, **kwargs):
    """One boto3 call; its errors become `StorageError` (`StorageIntegrityError` when the object
    is missing)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            raise StorageIntegrityError(f"{what}: no such object") from e
        raise StorageError(f"{what} failed: {e}") from e
    except (BotoCoreError, Boto3Error) as e:
        raise StorageError(f"{what} failed: {e}") from e


def s3_keys(client, bucket: str, prefix: str) -> list[str]:
    """Every key under `prefix` in `bucket` (all pages)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return s3_call(f"listing s3://{bucket}/{prefix}", lambda: [o["Key"] for page in pages for o in page.get("Contents", [])])


def s3_delete_keys(client, bucket: str, keys: list[str], what: str) -> None:
    """Delete `keys`, 1000 to a request (S3's limit); `StorageError` naming `what` when any fails."""
    for i in range(0, len(keys), 1000):
        out = s3_call(what, client.delete_objects, Bucket=bucket,
                      Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        if out.get("Errors"):
            raise StorageError(f"{what} failed for {len(out['Errors'])} objects: {out['Errors'][0]}")


def s3_delete_prefix(client, bucket: str, prefix: str) -> int:
    """Delete every object under `prefix`; returns how many there were."""
    keys = s3_keys(client, bucket, prefix)
    s3_delete_keys(client, bucket, keys, f"deleting s3://{bucket}/{prefix}")
    return len(keys)


class S3Storage:
    """Versions in an S3-compatible bucket, fetched into the local cache `root`."""

    def __init__(self, settings: StorageSettings, root: Path | str):
        if not settings.s3_bucket:
            raise ValueError("S3Storage needs settings.s3_bucket")
        self.root = Path(root)
        self.bucket = settings.s3_bucket
        self.prefix = f"{settings.s3_prefix}/" if settings.s3_prefix else ""
        self.client = s3_client(settings)
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # --- names -------------------------------------------------------------------------

    def key(self, tenant: str, version: int, name: str = "") -> str:
        """The object key of file `name` of a version (its key prefix for "")."""
        return f"{self.prefix}{tenant}/v{version}/{name}"

    def uri(self, tenant: str, version: int) -> str:
        return f"s3://{self.bucket}/{self.prefix}{tenant}/v{version}"

    def _parse(self, uri: str) -> tuple[str, int] | None:
        """(tenant, version) of a URI of this store; None for a local path."""
        if not uri.startswith("s3://"):
            return None
        head = f"s3://{self.bucket}/{self.prefix}"
        rest = uri[len(head):].split("/") if uri.startswith(head) else []
        if len(rest) != 2 or not rest[0] or not (m := VERSION_DIR.fullmatch(rest[1])):
            raise StorageError(f"{uri} is not a version in this store ({head}<tenant>/v<N>)")
        return rest[0], int(m.group(1))

    # --- the store ----------------------------------------------------------------------

    def _call(self, what: str, fn, *args, **kwargs):
        return s3_call(what, fn, *args, **kwargs)

    def _put(self, key: str, path: Path) -> None:
        self._call(f"uploading s3://{self.bucket}/{key}", self.client.upload_file, str(path), self.bucket, key)

    def _get(self, key: str, path: Path) -> None:
        self._call(f"downloading s3://{self.bucket}/{key}", self.client.download_file, self.bucket, key, str(path))

    def _keys(self, prefix: str) -> list[str]:
        return s3_keys(self.client, self.bucket, prefix)

    def manifest(self, tenant: str, version: int) -> Manifest:
        """The store's manifest of a version (`StorageIntegrityError`: none, so no version)."""
        key = self.key(tenant, version, MANIFEST_FILE)
        where = self.uri(tenant, version)
        try:
            body = self._call(f"reading s3://{self.bucket}/{key}", self.client.get_object, Bucket=self.bucket, Key=key)
        except StorageIntegrityError as e:
            raise StorageIntegrityError(f"{where} has no manifest: never published, deleted, or its upload "
                                        "was torn") from e
        m = Manifest.parse(self._call(f"reading s3://{self.bucket}/{key}", body["Body"].read), where)
        if (m.tenant, m.version) != (tenant, version):
            raise StorageIntegrityError(f"the manifest of {where} names {m.tenant} v{m.version}")
        return m

    def versions(self, tenant: str) -> list[int]:
        prefix = f"{self.prefix}{tenant}/"
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                      Delimiter="/")
        names = self._call(f"listing s3://{self.bucket}/{prefix}",
                           lambda: [p["Prefix"][len(prefix):].rstrip("/") for page in pages
                                    for p in page.get("CommonPrefixes", [])])
        return sorted(int(m.group(1)) for n in names if (m := VERSION_DIR.fullmatch(n)))

    def publish(self, tenant: str, version: int, folder: Path) -> str:
        uri = self.uri(tenant, version)
        if self._keys(self.key(tenant, version)):
            raise StorageError(f"{uri} already has objects; versions are never overwritten")
        manifest = Manifest.of(tenant, version, folder)
        for name in manifest.files:
            self._put(self.key(tenant, version, name), folder / name)
        (folder / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
        fsync_path(folder / MANIFEST_FILE)
        self._put(self.key(tenant, version, MANIFEST_FILE), folder / MANIFEST_FILE)   # last: now it exists
        final = self.root / tenant / f"v{version}"
        if Path(folder).resolve() != final.resolve():
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(folder, final)
            except OSError as e:
                raise StorageError(f"{uri} is stored, but caching it in {final} failed") from e
            fsync_path(final.parent)
        return uri

    def fetch(self, uri: str) -> Path:
        where = self._parse(uri)
        if where is None:
            return Path(uri)
        tenant, version = where
        final = self.root / tenant / f"v{version}"
        with self._lock(tenant, version):
            if final.is_dir():
                try:
                    self._check_cached(final, uri)
                    return final
                except StorageIntegrityError as e:
                    log.warning("the cached copy of %s is corrupt (%s); fetching it again", uri, e)
                    self._discard(final)
            manifest = self.manifest(tenant, version)
            tmp = final.parent / f".tmp-fetch-v{version}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir(parents=True)
                for name in manifest.files:
                    self._get(self.key(tenant, version, name), tmp / name)
                manifest.check(tmp, uri)
                (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
                for p in tmp.iterdir():
                    fsync_path(p)
                fsync_path(tmp)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not final.is_dir():
                        raise
                    self._check_cached(final, uri)   # another process fetched it first
                    shutil.rmtree(tmp, ignore_errors=True)
                    return final
                fsync_path(final.parent)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final

    def delete(self, tenant: str, versions: Iterable[int]) -> None:
        for n in versions:
            self._call(f"deleting {self.uri(tenant, n)}'s manifest", self.client.delete_object,
                       Bucket=self.bucket, Key=self.key(tenant, n, MANIFEST_FILE))   # first: from now on no version
            self._delete_keys(self._keys(self.key(tenant, n)), f"deleting {self.uri(tenant, n)}")
            shutil.rmtree(self.root / tenant / f"v{n}", ignore_errors=True)

    def delete_tenant(self, tenant: str) -> None:
        prefix = f"{self.prefix}{_tenant_dir(tenant)}/"
        self.delete(tenant, self.versions(tenant))   # manifests first, version by version
        # whatever else is left under the tenant's prefix
        self._delete_keys(self._keys(prefix), f"deleting s3://{self.bucket}/{prefix}")
        shutil.rmtree(self.root / tenant, ignore_errors=True)   # the cache

    def _delete_keys(self, keys: list[str], what: str) -> None:
        s3_delete_keys(self.client, self.bucket, keys, what)

    # --- the cache ----------------------------------------------------------------------

    def _lock(self, tenant: str, version: int) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault((tenant, version), threading.Lock())

    def _check_cached(self, folder: Path, uri: str) -> None:
        try:
            data = (folder / MANIFEST_FILE).read_bytes()
        except OSError as e:
            raise StorageIntegrityError(f"the cached copy of {uri} has no manifest") from e
        Manifest.parse(data, f"the cached copy of {uri}").check(folder, f"the cached copy of {uri}")

    def _discard(self, folder: Path) -> None:
        """Move a corrupt cached version aside (so nothing finds it) and delete it."""
        aside = folder.parent / f".tmp-corrupt-{folder.name}-{uuid.uuid4().hex[:8]}"
        os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)

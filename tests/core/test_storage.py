"""Adapter storage (`clora.storage`): the local folder, and an S3-compatible store (moto in
server mode, started by the suite: the `s3` fixture) whose versions are fetched into a verified
cache. A torn or corrupt version is refused and leaves no folder."""

from __future__ import annotations

import os
from pathlib import Path

import boto3
import pytest

from clora.storage import (MANIFEST_FILE, LocalStorage, S3Storage, StorageError, StorageIntegrityError,
                           StorageSettings, open_storage)

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": os.urandom(300_000),
         "clora_metadata.json": b'{"version": 1}'}


def _version_folder(parent: Path, name: str = ".tmp-v1-abcd1234", files: dict[str, bytes] = FILES) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    for file, data in files.items():
        (folder / file).write_bytes(data)
    return folder


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST_FILE}


def _client(settings: StorageSettings):
    return boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")


def _hidden(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")] if folder.is_dir() else []


# --- the local folder ------------------------------------------------------------------------

def test_the_local_storage_renames_a_version_into_place_and_names_it_by_its_path(tmp_path):
    st = LocalStorage(tmp_path / "adapters")
    tmp = _version_folder(tmp_path / "adapters" / "acme")
    uri = st.publish("acme", 1, tmp)
    assert uri == str((tmp_path / "adapters" / "acme" / "v1").resolve()) == st.uri("acme", 1)
    assert not tmp.exists() and st.fetch(uri) == Path(uri)
    assert _contents(Path(uri)) == FILES and not (Path(uri) / MANIFEST_FILE).exists()   # the folder as written
    assert st.versions("acme") == [1] and st.versions("nobody") == []
    with pytest.raises(StorageError, match="never overwritten"):
        st.publish("acme", 1, _version_folder(tmp_path / "adapters" / "acme", ".tmp-v1-again"))
    st.delete("acme", [1, 7])
    assert st.versions("acme") == []


def test_local_settings_open_the_local_storage_and_s3_settings_need_a_bucket(tmp_path, monkeypatch):
    assert isinstance(open_storage(StorageSettings(), tmp_path), LocalStorage)
    monkeypatch.setenv("CLORA_STORAGE_BACKEND", "s3")
    with pytest.raises(ValueError, match="s3_bucket is required"):
        StorageSettings()
    monkeypatch.setenv("CLORA_STORAGE_S3_BUCKET", "adapters")
    monkeypatch.setenv("CLORA_STORAGE_S3_PREFIX", "/prod/adapters/")
    monkeypatch.setenv("CLORA_STORAGE_S3_ACCESS_KEY_ID", "id")
    with pytest.raises(ValueError, match="both s3_access_key_id and s3_secret_access_key"):
        StorageSettings()
    monkeypatch.setenv("CLORA_STORAGE_S3_SECRET_ACCESS_KEY", "secret")
    s = StorageSettings()
    assert (s.backend, s.s3_bucket, s.s3_prefix) == ("s3", "adapters", "prod/adapters")
    assert S3Storage(s, tmp_path).uri("acme", 3) == "s3://adapters/prod/adapters/acme/v3"


# --- an S3-compatible store ------------------------------------------------------------------

@pytest.fixture
def stores(s3_storage_settings, tmp_path):
    """(the publishing host's storage, a second host's): one bucket, two cache folders."""
    return S3Storage(s3_storage_settings, tmp_path / "learner"), S3Storage(s3_storage_settings, tmp_path / "serving")


@pytest.mark.integration
def test_a_version_published_on_one_host_is_fetched_identically_on_another(stores, s3_storage_settings):
    learner, serving = stores
    uri = learner.publish("acme", 3, _version_folder(learner.root / "acme"))
    assert uri == f"s3://{s3_storage_settings.s3_bucket}/adapters/acme/v3"
    assert _contents(learner.root / "acme" / "v3") == FILES     # the publisher's copy is its cache
    keys = sorted(o["Key"] for o in _client(s3_storage_settings).list_objects_v2(
        Bucket=s3_storage_settings.s3_bucket)["Contents"])
    assert keys == sorted(f"adapters/acme/v3/{n}" for n in [*FILES, MANIFEST_FILE])
    folder = serving.fetch(uri)
    assert folder == serving.root / "acme" / "v3" and _contents(folder) == FILES
    assert _hidden(folder.parent) == []                         # no temporary folder left
    assert serving.fetch(uri) == folder                         # cached: verified, not downloaded again
    assert serving.versions("acme") == [3] and serving.versions("other") == []
    assert serving.fetch("/some/local/folder") == Path("/some/local/folder")   # a local path is used as it is
    with pytest.raises(StorageError, match="not a version in this store"):
        serving.fetch("s3://another-bucket/adapters/acme/v3")


@pytest.mark.integration
def test_a_torn_upload_leaves_no_version_and_its_number_stays_taken(stores, monkeypatch):
    learner, serving = stores
    real, uploaded = learner._put, []

    def dies_after_one(key, path):
        if uploaded:
            raise StorageError("the process died here")
        uploaded.append(key)
        real(key, path)
    monkeypatch.setattr(learner, "_put", dies_after_one)
    with pytest.raises(StorageError, match="died"):
        learner.publish("acme", 1, _version_folder(learner.root / "acme"))
    assert len(uploaded) == 1                          # one object is in the store, the manifest is not
    assert learner.versions("acme") == [1]             # so the number is taken ...
    with pytest.raises(StorageIntegrityError, match="no manifest"):
        serving.fetch(learner.uri("acme", 1))          # ... but nothing fetches it
    assert not (serving.root / "acme" / "v1").exists() and _hidden(serving.root / "acme") == []
    monkeypatch.undo()
    with pytest.raises(StorageError, match="never overwritten"):
        learner.publish("acme", 1, _version_folder(learner.root / "acme", ".tmp-v1-again"))


@pytest.mark.integration
def test_a_corrupt_object_in_the_store_is_refused_and_leaves_no_folder(stores, s3_storage_settings):
    learner, serving = stores
    uri = learner.publish("acme", 1, _version_folder(learner.root / "acme"))
    _client(s3_storage_settings).put_object(Bucket=s3_storage_settings.s3_bucket,
                                            Key="adapters/acme/v1/adapter_model.safetensors", Body=b"flipped bits")
    with pytest.raises(StorageIntegrityError, match="adapter_model.safetensors has 12 bytes"):
        serving.fetch(uri)
    assert not (serving.root / "acme" / "v1").exists() and _hidden(serving.root / "acme") == []
    _client(s3_storage_settings).delete_object(Bucket=s3_storage_settings.s3_bucket,
                                               Key="adapters/acme/v1/adapter_config.json")
    with pytest.raises(StorageIntegrityError, match="no such object"):
        serving.fetch(uri)
    assert not (serving.root / "acme" / "v1").exists() and _hidden(serving.root / "acme") == []


@pytest.mark.integration
def test_a_corrupt_cached_copy_is_never_returned(stores, s3_storage_settings):
    learner, serving = stores
    uri = learner.publish("acme", 1, _version_folder(learner.root / "acme"))
    folder = serving.fetch(uri)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * len(FILES["adapter_model.safetensors"]))
    assert serving.fetch(uri) == folder and _contents(folder) == FILES   # dropped and fetched again
    (folder / "adapter_config.json").write_bytes(b'{"r": 8}')
    _client(s3_storage_settings).delete_object(Bucket=s3_storage_settings.s3_bucket,
                                               Key=f"adapters/acme/v1/{MANIFEST_FILE}")
    with pytest.raises(StorageIntegrityError, match="no manifest"):    # the store no longer has it either
        serving.fetch(uri)
    assert not folder.exists() and _hidden(serving.root / "acme") == []


@pytest.mark.integration
def test_delete_removes_every_object_of_a_version_and_its_cached_copy(stores, s3_storage_settings):
    learner, serving = stores
    for v in (1, 2, 3):
        learner.publish("acme", v, _version_folder(learner.root / "acme", f".tmp-v{v}"))
    learner.publish("beta", 1, _version_folder(learner.root / "beta"))
    serving.fetch(learner.uri("acme", 2))
    learner.delete("acme", [1, 2, 9])
    serving.delete("acme", [2])                                  # a second delete finds nothing: no error
    assert learner.versions("acme") == [3] and learner.versions("beta") == [1]
    keys = {o["Key"] for o in _client(s3_storage_settings).list_objects_v2(
        Bucket=s3_storage_settings.s3_bucket)["Contents"]}
    assert not any(k.startswith(("adapters/acme/v1/", "adapters/acme/v2/")) for k in keys)
    assert not (learner.root / "acme" / "v1").exists() and not (serving.root / "acme" / "v2").exists()
    with pytest.raises(StorageIntegrityError):
        serving.fetch(learner.uri("acme", 1))


@pytest.mark.integration
def test_an_unreachable_store_is_a_storage_error_not_an_integrity_error(s3_storage_settings, tmp_path):
    from clora.procs import free_port

    down = S3Storage(s3_storage_settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{free_port()}",
                                                            "s3_timeout_s": 1}), tmp_path)
    with pytest.raises(StorageError) as e:
        down.fetch(down.uri("acme", 1))
    assert not isinstance(e.value, StorageIntegrityError)

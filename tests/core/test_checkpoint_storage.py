"""Checkpoint storage (`clora.checkpoint_storage`), local and on a real S3-compatible server (the
suite's moto `s3` fixture): entries ordered by (token, seq), a stale token refused, atomic
writes, trimming, the single-file layout from before read as the oldest entry, and a corrupt
object refused by its checksum."""

from __future__ import annotations

import boto3
import pytest

from clora.checkpoint_storage import KEEP, CheckpointEntry, LocalCheckpoints, S3Checkpoints, open_checkpoint_storage
from clora.fencing import FencedOut
from clora.storage import StorageIntegrityError, StorageSettings


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalCheckpoints(tmp_path / "ckpt")
    settings = request.getfixturevalue("s3_storage_settings")
    store = open_checkpoint_storage(settings, tmp_path / "staging")
    assert isinstance(store, S3Checkpoints)
    return store


def _put(store, name: str, token: int, body: bytes) -> CheckpointEntry:
    path = store.staging()
    path.write_bytes(body)
    return store.put(name, token, path)


def _read(store, entry: CheckpointEntry) -> bytes:
    with store.open(entry) as path:
        return path.read_bytes()


def test_the_newest_entry_is_the_largest_token_then_the_latest_write(store):
    assert store.newest("tenants/acme") is None
    assert _put(store, "tenants/acme", 3, b"a") == CheckpointEntry(3, 1, "tenants/acme")
    assert _put(store, "tenants/acme", 3, b"b") == CheckpointEntry(3, 2, "tenants/acme")
    assert _put(store, "tenants/acme", 7, b"c") == CheckpointEntry(7, 1, "tenants/acme")   # a new holder
    newest = store.newest("tenants/acme")
    assert newest == CheckpointEntry(7, 1, "tenants/acme") and _read(store, newest) == b"c"
    assert store.newest("tenants/beta") is None and store.newest("tinker/acme--9f") is None


def test_a_stale_token_is_refused_and_leaves_the_newer_holders_checkpoint(store):
    _put(store, "tenants/acme", 7, b"new holder")
    staged = store.staging()
    staged.write_bytes(b"old holder")
    with pytest.raises(FencedOut, match="token 7 has written it, token 3 is stale"):
        store.put("tenants/acme", 3, staged)
    assert not staged.exists()                   # nothing left behind
    assert _read(store, store.newest("tenants/acme")) == b"new holder"


def test_older_entries_are_trimmed_to_the_newest_few(store):
    for i in range(5):
        _put(store, "tenants/acme", 4, bytes([i]))
    newest = store.newest("tenants/acme")
    assert newest.seq == 5 and _read(store, newest) == bytes([4])
    assert [e.seq for e in store.entries("tenants/acme")] == list(range(6 - KEEP, 6))
    assert store.clean_partial() == []           # nothing half-written


def test_the_single_file_layout_from_before_is_read_as_the_oldest_entry(tmp_path):
    store = LocalCheckpoints(tmp_path)
    (tmp_path / "acme.safetensors").write_bytes(b"before")
    (tmp_path / "tinker").mkdir()
    (tmp_path / "tinker" / "acme--9f.safetensors").write_bytes(b"run before")
    assert store.newest("tenants/acme") == CheckpointEntry(0, 0, "tenants/acme")
    assert _read(store, store.newest("tenants/acme")) == b"before"
    assert _read(store, store.newest("tinker/acme--9f")) == b"run before"
    _put(store, "tenants/acme", 0, b"after")     # the sole learner writes token 0, after it
    _put(store, "tenants/acme", 0, b"after 2")
    assert _read(store, store.newest("tenants/acme")) == b"after 2"
    assert not (tmp_path / "acme.safetensors").exists()     # trimmed like any older entry


def test_a_crash_mid_write_leaves_only_a_temporary_file_which_is_cleaned(tmp_path):
    store = LocalCheckpoints(tmp_path)
    _put(store, "tenants/acme", 1, b"whole")
    torn = store.staging()
    torn.write_bytes(b"\0" * 10)                 # a crash before the rename
    assert store.clean_partial() == [torn]
    assert _read(store, store.newest("tenants/acme")) == b"whole"


def test_a_corrupt_object_is_refused_by_its_checksum(s3_storage_settings, tmp_path):
    store = S3Checkpoints(s3_storage_settings, tmp_path)
    entry = _put(store, "tenants/acme", 2, b"training state")
    s3 = boto3.client("s3", endpoint_url=s3_storage_settings.s3_endpoint_url, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    head = s3.head_object(Bucket=store.bucket, Key=store.key(entry))
    s3.put_object(Bucket=store.bucket, Key=store.key(entry), Body=b"training statE", Metadata=head["Metadata"])
    with pytest.raises(StorageIntegrityError, match="sha256"):
        _read(store, entry)
    assert list(tmp_path.glob(".tmp-*")) == []   # the download is not left behind


@pytest.mark.parametrize("name", ["acme", "tenants/", "tenants/../x", "Tenants/acme", "tenants/a/b"])
def test_names_are_a_space_and_an_id(tmp_path, name):
    with pytest.raises(ValueError, match="not a checkpoint name"):
        LocalCheckpoints(tmp_path).newest(name)


def test_the_checkpoint_prefix_must_stay_apart_from_the_versions():
    with pytest.raises(ValueError, match="apart from s3_prefix"):
        StorageSettings(backend="s3", s3_bucket="b", s3_prefix="adapters", s3_checkpoint_prefix="adapters")
    with pytest.raises(ValueError, match="apart from s3_prefix"):
        StorageSettings(backend="s3", s3_bucket="b", s3_prefix="clora", s3_checkpoint_prefix="clora/checkpoints")
    assert StorageSettings(backend="s3", s3_bucket="b", s3_prefix="").s3_checkpoint_prefix == "checkpoints"

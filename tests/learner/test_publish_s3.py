"""The learner's `Publisher` over an S3-compatible store (moto in server mode, the suite's `s3`
fixture): versions are uploaded and checksummed before the registry records them, read back
through a verified cache, never renumbered after a torn upload, and pruned from the store."""

from __future__ import annotations

import os

import boto3
import pytest
import torch

from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.peft_io import AdapterFormatError, read_adapter
from clora.learner.publish import Publisher, PublishError
from clora.storage import MANIFEST_FILE, S3Storage, StorageError

from .helpers import FakeRegistry

pytestmark = pytest.mark.integration


@pytest.fixture()
def layout(tiny):
    return LoraModel(tiny[0], LoraSpec(rank=4, alpha=8)).layout


def _publisher(layout, settings, folder, registry=None) -> Publisher:
    """A learner on its own host: its adapters folder is its cache of the shared store."""
    return Publisher(folder, registry or FakeRegistry(), lambda e: None, "tiny-base", layout,
                     storage=S3Storage(settings, folder))


def _flat(layout, seed: int) -> torch.Tensor:
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))


def _keys(settings) -> list[str]:
    client = boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=settings.s3_bucket).get("Contents", []))


def test_a_version_published_to_s3_loads_identically_from_another_hosts_cache(layout, s3_storage_settings, tmp_path):
    p = _publisher(layout, s3_storage_settings, tmp_path / "learner")
    p.publish("acme", _flat(layout, 1), step=1, examples_seen=8, eval_scores={})
    v2 = p.publish("acme", _flat(layout, 2), step=2, examples_seen=16, eval_scores={}, parent_version=1)
    assert v2.path == f"s3://{s3_storage_settings.s3_bucket}/adapters/acme/v2"
    assert p.registry.adapter_versions("acme")[-1].path == v2.path and p.registry.live_version("acme") == 2
    assert f"adapters/acme/v2/{MANIFEST_FILE}" in _keys(s3_storage_settings)
    serving = S3Storage(s3_storage_settings, tmp_path / "serving")
    fetched = serving.fetch(v2.path)
    assert torch.equal(read_adapter(fetched, layout), _flat(layout, 2))
    for name in ("adapter_config.json", "adapter_model.safetensors", "clora_metadata.json", MANIFEST_FILE):
        assert (fetched / name).read_bytes() == (p.tenant_dir("acme") / "v2" / name).read_bytes()
    # a learner on a fresh host (failover: no local copy) reads the live version through its cache
    other = _publisher(layout, s3_storage_settings, tmp_path / "learner-2", p.registry)
    assert other.versions_on_disk("acme") == []
    live = other.live_weights("acme")
    assert live.version == 2 and torch.equal(live.flat, _flat(layout, 2))
    assert other.rollback("acme", 1).version == 1 and other.versions_on_disk("acme") == [1, 2]


def test_a_torn_upload_records_nothing_and_its_number_is_never_reused(layout, s3_storage_settings, tmp_path,
                                                                      monkeypatch):
    p = _publisher(layout, s3_storage_settings, tmp_path / "learner")
    p.publish("acme", _flat(layout, 1), step=1, examples_seen=1, eval_scores={})
    real, calls = p.storage._put, []

    def dies_midway(key, path):
        calls.append(key)
        if len(calls) == 2:
            raise StorageError("killed between objects")
        real(key, path)
    monkeypatch.setattr(p.storage, "_put", dies_midway)
    with pytest.raises(PublishError, match="acme v2") as e:
        p.publish("acme", _flat(layout, 2), step=2, examples_seen=2, eval_scores={})
    assert isinstance(e.value.__cause__, StorageError)
    assert [v.version for v in p.registry.adapter_versions("acme")] == [1] and p.registry.live_version("acme") == 1
    assert os.listdir(p.tenant_dir("acme")) == ["v1"]           # no local folder, no temporary one
    assert any(k.startswith("adapters/acme/v2/") for k in _keys(s3_storage_settings))   # the torn objects
    monkeypatch.undo()
    # another learner, without the first one's folder, numbers past the torn version too
    other = _publisher(layout, s3_storage_settings, tmp_path / "learner-2", p.registry)
    assert other.publish("acme", _flat(layout, 3), step=3, examples_seen=3, eval_scores={}).version == 3
    with pytest.raises(AdapterFormatError, match="no manifest"):
        other.weights("acme", 2)


def test_a_corrupt_stored_version_is_unreadable_not_loaded(layout, s3_storage_settings, tmp_path):
    p = _publisher(layout, s3_storage_settings, tmp_path / "learner")
    v1 = p.publish("acme", _flat(layout, 1), step=1, examples_seen=1, eval_scores={})
    p.publish("acme", _flat(layout, 2), step=2, examples_seen=2, eval_scores={}, parent_version=1)
    client = boto3.client("s3", endpoint_url=s3_storage_settings.s3_endpoint_url, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.put_object(Bucket=s3_storage_settings.s3_bucket, Key="adapters/acme/v1/adapter_model.safetensors",
                      Body=b"not the weights")
    other = _publisher(layout, s3_storage_settings, tmp_path / "learner-2", p.registry)
    with pytest.raises(AdapterFormatError, match="has 15 bytes"):     # rollback refuses to make it live
        other.rollback("acme", v1.version)
    assert p.registry.live_version("acme") == 2 and other.versions_on_disk("acme") == []


def test_prune_deletes_the_pruned_versions_objects(layout, s3_storage_settings, tmp_path):
    p = _publisher(layout, s3_storage_settings, tmp_path / "learner")
    for i in range(1, 6):
        p.publish("acme", _flat(layout, i), step=i, examples_seen=i, eval_scores={}, parent_version=i - 1 or None)
    assert p.prune("acme", 2) == [1, 2]
    assert p.storage.versions("acme") == [3, 4, 5] and p.versions_on_disk("acme") == [3, 4, 5]
    assert not any(k.startswith(("adapters/acme/v1/", "adapters/acme/v2/")) for k in _keys(s3_storage_settings))

"""Saved Tinker weights in the S3 adapter store (issue 20): the training API and the learners
need no shared volume. On the suite's S3 server (moto): two hosts' caches see one checkpoint,
an overwrite replaces it whole, a torn or corrupt upload is never read; and through the
unchanged `tinker` SDK, with the API and the learner each on its own folder, save / load /
weights_info / save for the sampler work as on one host."""

from __future__ import annotations

import json

import boto3
import pytest
import torch

from clora.storage import StorageIntegrityError
from clora.trainapi.weights import CURRENT, INFO_FILE, WRITE_FILE, CheckpointDir, CheckpointInfo, NotFound, \
    TinkerPath

P = TinkerPath("sess:train:0", "weights", "two")


def info(step: int) -> CheckpointInfo:
    return CheckpointInfo(path=str(P), tenant="acme", base_model="tiny", lora_rank=8, train_attn=True,
                          train_mlp=True, step=step, has_optimizer=True, created_at=1.0)


def filler(payload: bytes, step: int):
    def fill(folder):
        (folder / "adapter_model.safetensors").write_bytes(payload)
        (folder / "state.safetensors").write_bytes(payload[::-1])
        return info(step)
    return fill


def objects(settings) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=settings.s3_bucket).get("Contents", []))


@pytest.fixture
def hosts(tmp_path, s3_storage_settings):
    """Two hosts' checkpoint folders over one store."""
    return (CheckpointDir(tmp_path / "a", s3_storage_settings), CheckpointDir(tmp_path / "b", s3_storage_settings),
            s3_storage_settings)


def test_a_checkpoint_written_on_one_host_is_read_whole_on_another(hosts):
    a, b, _ = hosts
    assert not b.exists("acme", P)
    a.write("acme", P, False, filler(b"one" * 1000, 2))
    assert b.exists("acme", P) and b.info("acme", P) == info(2)
    folder, got = b.find("acme", P)
    assert got == info(2)
    assert (folder / "adapter_model.safetensors").read_bytes() == b"one" * 1000
    assert (folder / "state.safetensors").read_bytes() == (b"one" * 1000)[::-1]
    assert json.loads((folder / INFO_FILE).read_text())["step"] == 2
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]   # no temporary left


def test_a_deleted_tenants_checkpoints_leave_the_store_and_the_cache_and_no_other_tenants_do(hosts):
    a, b, settings = hosts
    a.write("acme", P, False, filler(b"x", 1))
    a.write("acme-two", P, False, filler(b"y", 1))        # a tenant whose id starts with the other's
    b.find("acme", P)                                     # cached on b too
    assert any("/tinker-weights/acme/" in k for k in objects(settings))
    a.delete_tenant("acme")
    assert not any("/tinker-weights/acme/" in k for k in objects(settings))
    assert any("/tinker-weights/acme-two/" in k for k in objects(settings))
    assert not (a.root / "acme").exists() and not b.exists("acme", P)
    assert b.find("acme-two", P)[1] == info(1)
    a.delete_tenant("acme")                               # safe to repeat
    with pytest.raises(ValueError):
        a.delete_tenant("..")


def test_another_tenants_checkpoint_is_not_found(hosts):
    a, b, _ = hosts
    a.write("acme", P, False, filler(b"x", 1))
    with pytest.raises(NotFound):
        b.find("beta", P)
    assert not b.exists("beta", P)


def test_an_overwrite_replaces_the_checkpoint_whole_and_the_stale_cache(hosts):
    a, b, settings = hosts
    a.write("acme", P, False, filler(b"old", 1))
    b.find("acme", P)                                        # b caches the first write
    with pytest.raises(FileExistsError):
        a.write("acme", P, False, filler(b"new", 5))
    assert b.find("acme", P)[1].step == 1                    # refused: unchanged
    a.write("acme", P, True, filler(b"new", 5))
    folder, got = b.find("acme", P)
    assert got.step == 5 and (folder / "adapter_model.safetensors").read_bytes() == b"new"
    keys = objects(settings)
    writes = {k.split("/")[-2] for k in keys if not k.endswith(CURRENT)}
    assert writes == {(folder / WRITE_FILE).read_text()}   # the first write's objects are gone
    assert sum(k.endswith(CURRENT) for k in keys) == 1


def test_a_torn_upload_is_no_checkpoint(hosts, tmp_path):
    a, b, settings = hosts
    a.write("acme", P, False, filler(b"x", 1))
    remote = a.remote
    s3 = remote.client
    s3.delete_object(Bucket=settings.s3_bucket, Key=remote.key("acme", P, CURRENT))   # as a crash before the PUT
    assert not b.exists("acme", P)
    with pytest.raises(NotFound):
        b.find("acme", P)
    a.write("acme", P, False, filler(b"again", 2))          # and the name can be written again
    assert b.find("acme", P)[1].step == 2


def test_a_corrupt_object_is_refused_and_leaves_no_folder(hosts):
    a, b, settings = hosts
    a.write("acme", P, False, filler(b"good" * 100, 1))
    m = a.remote.current("acme", P)
    a.remote.client.put_object(Bucket=settings.s3_bucket, Body=b"evil" * 100,
                               Key=a.remote.key("acme", P, m.write_id, "adapter_model.safetensors"))
    with pytest.raises(StorageIntegrityError):
        b.find("acme", P)
    parent = b.folder("acme", P).parent
    assert not parent.exists() or not list(parent.iterdir())   # neither the folder nor a temporary


def test_a_tampered_cache_is_fetched_again(hosts):
    a, b, _ = hosts
    a.write("acme", P, False, filler(b"good", 1))
    folder, _ = b.find("acme", P)
    (folder / "state.safetensors").write_bytes(b"bad!")
    folder, _ = b.find("acme", P)
    assert (folder / "state.safetensors").read_bytes() == b"doog"


tinker = pytest.importorskip("tinker")

from .conftest import RANK  # noqa: E402
from .test_sdk import sft_datum  # noqa: E402

ADAM = tinker.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
DATA = [sft_datum([10, 11, 12], [40, 41, 42, 43]), sft_datum([20, 21], [40, 41, 42, 43])]


def test_the_sdk_saves_and_loads_through_the_store_with_no_shared_folder(service_s3):
    svc = service_s3
    client = tinker.ServiceClient(base_url=svc.url, api_key=svc.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    for _ in range(2):
        training.forward_backward(DATA, "cross_entropy").result()
        training.optim_step(ADAM).result()
    key = f"acme/tinker/{training.model_id}"
    saved = svc.work.store.state(key).buffer.clone()
    path = training.save_state("two").result().path
    info_ = client.create_rest_client().get_weights_info_by_tinker_path(path).result()
    assert info_.lora_rank == RANK
    training.forward_backward(DATA, "cross_entropy").result()
    training.optim_step(ADAM).result()
    assert not torch.equal(svc.work.store.state(key).buffer[0], saved[0])
    training.load_state_with_optimizer(path).result()
    assert torch.equal(svc.work.store.state(key).buffer[:3], saved[:3])
    # a second model made from the checkpoint (load_weights form A) starts from it
    other = client.create_training_client_from_state_with_optimizer(path).result()
    assert torch.equal(svc.work.store.state(f"acme/tinker/{other.model_id}").buffer[:3], saved[:3])
    sampler_path = training.save_weights_for_sampler("final").result().path
    assert svc.registry.tinker_sampler_version("acme", sampler_path) is not None
    # the API never needed the checkpoints' files: only their current.json in the store
    api_dir = svc.api_settings.checkpoints_dir
    assert not api_dir.exists() or not [p for p in api_dir.rglob("*") if p.is_file()]
    # beta cannot read acme's checkpoint by its path
    beta = tinker.ServiceClient(base_url=svc.url, api_key=svc.keys["beta"])
    with pytest.raises(Exception, match="(?i)not.found|404|no checkpoint"):
        beta.create_rest_client().get_weights_info_by_tinker_path(path).result()

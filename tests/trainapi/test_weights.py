"""Weights through the unchanged `tinker` SDK 0.38: save, keep training, load back; bad paths
are 4xx naming the field and change nothing."""

from __future__ import annotations

import json

import pytest
import torch

tinker = pytest.importorskip("tinker")

from clora.learner.peft_io import CONFIG_FILE, WEIGHTS_FILE, read_adapter  # noqa: E402

from .conftest import RANK  # noqa: E402
from .test_bad_input import _acme_key, assert_error, post, result  # noqa: E402,F401 - _acme_key: autouse
from .test_sdk import sft_datum  # noqa: E402

ADAM = tinker.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
DATA = [sft_datum([10, 11, 12], [40, 41, 42, 43]), sft_datum([20, 21], [40, 41, 42, 43])]


def train(training, steps: int) -> None:
    for _ in range(steps):
        training.forward_backward(DATA, "cross_entropy").result()
        training.optim_step(ADAM).result()


def snapshot(backend, model_id: str):
    """(step, (4, P) buffer) of the run, flushed from the device."""
    st = backend.store.state(f"acme/tinker/{model_id}")
    return st.step, st.buffer.clone()


@pytest.fixture()
def trained(service):
    """(url, backend, service client, training client) after 2 steps and a save named "two"."""
    url, backend = service.url, service.work.backend
    client = tinker.ServiceClient(base_url=url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK, train_unembed=True).result()
    train(training, 2)
    return url, backend, client, training


def test_load_with_optimizer_restores_the_saved_weights_and_adam_state(trained):
    url, backend, _, training = trained
    saved = snapshot(backend, training.model_id)
    path = training.save_state("two").result().path
    assert path == f"tinker://{training.model_id}/weights/two"
    train(training, 2)
    moved = snapshot(backend, training.model_id)
    assert moved[0] == 4 and not torch.equal(moved[1][0], saved[1][0])
    training.load_state_with_optimizer(path).result()
    step, buf = snapshot(backend, training.model_id)
    assert step == saved[0] == 2
    assert torch.equal(buf[:3], saved[1][:3])          # master | exp_avg | exp_avg_sq
    assert not buf[3].any()                             # no gradient carried over
    train(training, 1)                                  # the run goes on from the loaded step
    assert snapshot(backend, training.model_id)[0] == 3


def test_load_without_optimizer_restores_the_weights_with_fresh_adam_state(trained):
    url, backend, _, training = trained
    saved = snapshot(backend, training.model_id)
    path = training.save_state("two").result().path
    train(training, 2)
    training.load_state(path).result()
    step, buf = snapshot(backend, training.model_id)
    assert step == 0 and torch.equal(buf[0], saved[1][0]) and not buf[1:].any()


def test_a_new_training_client_from_state_and_weights_info(trained):
    url, backend, client, training = trained
    saved = snapshot(backend, training.model_id)
    path = training.save_state("two").result().path
    info = client.create_rest_client().get_weights_info_by_tinker_path(path).result()
    assert info.is_lora and info.lora_rank == RANK and info.base_model == "tiny"
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != training.model_id
    step, buf = snapshot(backend, resumed.model_id)
    assert step == 2 and torch.equal(buf[:3], saved[1][:3])
    train(resumed, 1)   # its first training request is seq 1
    assert snapshot(backend, resumed.model_id)[0] == 3


def test_a_generated_name_and_a_sampler_save_write_peft_folders(trained, tmp_path):
    url, backend, _, training = trained
    out = training.save_weights_for_sampler("final").result()   # seq 5
    assert out.path == f"tinker://{training.model_id}/sampler_weights/final"
    folder = tmp_path / "checkpoints" / "acme" / training.model_id / "sampler_weights" / "final"
    assert {p.name for p in folder.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, "tinker_checkpoint.json"}
    assert json.loads((folder / CONFIG_FILE).read_text())["r"] == RANK
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]   # no temporary left
    assert torch.equal(read_adapter(folder, backend.model.layout), snapshot(backend, training.model_id)[1][0])
    r = post(url, "save_weights", {"model_id": training.model_id, "seq_id": 6})   # no name: one is made
    assert r.status_code == 200, r.text
    path = result(url, r.json()["request_id"]).json()["path"]
    assert path.startswith(f"tinker://{training.model_id}/weights/seq-6-")


def test_bad_paths_are_4xx_naming_the_field_with_no_state_change(trained, service):
    url, backend, client, training = trained
    mine = training.save_state("two").result().path
    train(training, 1)
    before = snapshot(backend, training.model_id)
    # beta's own run and checkpoint; acme asking for it sees nothing
    beta = tinker.ServiceClient(base_url=url, api_key=service.keys["beta"])
    beta_training = beta.create_lora_training_client(base_model="tiny", rank=RANK).result()
    theirs = beta_training.save_state("two").result().path
    with pytest.raises(tinker.NotFoundError):   # seq 8 through the SDK: it surfaces the 404
        training.load_state_with_optimizer(theirs).result()
    seq = 9   # the SDK sent 1-8: 2 x (forward_backward, optim_step), the save, 1 x both, the load
    cases = [(theirs, 404), (mine.replace("/two", "/nope"), 404), ("tinker://x/weights/../../etc", 400),
             ("s3://bucket/two", 400), (mine.replace("/weights/", "/sampler_weights/"), 400)]
    for path, status in cases:
        assert_error(post(url, "load_weights", {"model_id": training.model_id, "seq_id": seq, "path": path,
                                                "optimizer": True}), status, "path")
        seq += 1
    assert_error(post(url, "weights_info", {"tinker_path": theirs}), 404, "tinker_path")
    assert_error(post(url, "load_weights", {"model_id": beta_training.model_id, "seq_id": 1, "path": theirs,
                                            "optimizer": True}), 404, "model_id")
    assert_error(post(url, "save_weights", {"model_id": training.model_id, "seq_id": seq, "path": "two"}),
                 400, "path")   # exists, no overwrite
    seq += 1
    assert_error(post(url, "save_weights", {"model_id": training.model_id, "seq_id": seq, "path": ".hidden"}),
                 400, "path")
    after = snapshot(backend, training.model_id)
    assert after[0] == before[0] and torch.equal(after[1], before[1])

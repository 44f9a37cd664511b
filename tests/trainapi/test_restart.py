"""A learner restart in the middle of a Tinker session: requests wait in Redis and run on the new
learner, a gradient the restart lost fails the next optim_step clearly with nothing applied, and a
step applied just before the learner died is never applied twice."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")

from clora.trainapi import queue  # noqa: E402
from clora.trainapi.executor import TinkerWork  # noqa: E402

from .conftest import RANK  # noqa: E402
from .test_sdk import sft_datum  # noqa: E402

DATA = [sft_datum([10, 11, 12], [40, 41, 42, 43]), sft_datum([20, 21], [40, 41, 42, 43])]
ADAM = tinker.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def run_state(service, model_id):
    st = service.learner.store.state(f"acme/tinker/{model_id}")
    return st.step, st.buffer[0].clone()


def test_a_restart_keeps_the_queue_and_a_lost_gradient_fails_the_step_with_nothing_applied(service):
    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    for _ in range(2):
        training.forward_backward(DATA, "cross_entropy").result()
        training.optim_step(ADAM).result()
    training.forward_backward(DATA, "cross_entropy").result()   # its gradient lives in the learner's memory
    step, weights = run_state(service, training.model_id)
    assert step == 2

    service.stop_learner()
    pending = training.optim_step(ADAM)   # accepted while no learner runs: it waits in Redis
    service.start_learner(service.new_learner())
    with pytest.raises(Exception, match="lost the gradient"):
        pending.result()
    assert run_state(service, training.model_id)[0] == 2
    assert torch.equal(run_state(service, training.model_id)[1], weights)   # restored, not half-stepped

    # the session goes on: a fresh forward_backward and the step applies
    fb = training.forward_backward(DATA, "cross_entropy").result()
    training.optim_step(ADAM).result()
    assert run_state(service, training.model_id)[0] == 3
    assert fb.metrics["loss:sum"] > 0


def test_a_step_checkpointed_but_not_answered_before_a_crash_is_answered_not_repeated(service, monkeypatch):
    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    training.forward_backward(DATA, "cross_entropy").result()
    key = f"acme/tinker/{training.model_id}"

    # the learner applies and checkpoints the step, then dies before it can answer
    real_finish = queue.finish

    def die_on_the_step(*args, **kwargs):
        if (kwargs.get("result_json") or {}).get("type") == "optim_step":
            raise SystemExit("killed between the checkpoint and the answer")
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(queue, "finish", die_on_the_step)
    pending = training.optim_step(ADAM)
    service.wait_learner_dead()
    monkeypatch.setattr(queue, "finish", real_finish)
    assert queue.head(service.redis, key) is not None   # still queued: nothing was answered

    learner = service.new_learner()
    assert isinstance(learner.external, TinkerWork)
    assert learner.external.load(key) and learner.store.peek(key).step == 1   # the checkpoint holds the step
    service.start_learner(learner)
    out = pending.result()
    assert out.metrics["step:max"] == 1.0
    assert run_state(service, training.model_id)[0] == 1   # answered from the checkpoint, not stepped again


def test_the_api_restarting_mid_session_loses_nothing_and_the_session_goes_on(service):
    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    training.forward_backward(DATA, "cross_entropy").result()
    service.stop_learner()
    pending = training.optim_step(ADAM)           # accepted, then the API process goes away
    service.stop_api()
    service.serve_api()                           # a new process on the same port, from Redis alone
    service.start_learner(service.new_learner())
    with pytest.raises(Exception, match="lost the gradient"):   # the learner restarted too
        pending.result()
    out = training.forward_backward(DATA, "cross_entropy").result()   # same model, next seq_id
    step = training.optim_step(ADAM).result()
    assert step.metrics["step:max"] == 1.0 and out.metrics["loss:sum"] > 0
    # a retried POST of an old seq_id still finds its own request; a gap is still refused
    import httpx

    key = {"X-API-Key": service.keys["acme"]}
    retry = httpx.post(f"{service.url}/api/v1/optim_step", headers=key, timeout=30,
                       json={"model_id": training.model_id, "seq_id": 2, "adam_params": ADAM.model_dump()})
    assert retry.status_code == 200, retry.text
    again = httpx.post(f"{service.url}/api/v1/retrieve_future", headers=key, timeout=30,
                       json={"request_id": retry.json()["request_id"]})
    assert "lost the gradient" in again.json()["error"]   # the same request's outcome, not a new step
    gap = httpx.post(f"{service.url}/api/v1/optim_step", headers=key, timeout=30,
                     json={"model_id": training.model_id, "seq_id": 99, "adam_params": ADAM.model_dump()})
    assert gap.status_code == 400 and gap.json()["error"]["field"] == "seq_id"


def test_a_tenant_deleted_while_its_step_runs_gets_no_checkpoint_or_record_back(service, monkeypatch, tmp_path):
    """The control plane deletes a tenant (retire, then `delete_tenant_runs`) while the learner
    is inside one of its run's optim_step: the step writes no checkpoint after the deletion and
    finishes nothing, so nothing of the run outlives the delete; other tenants' runs go on."""
    from clora.checkpoint_storage import LocalCheckpoints
    from clora.trainapi.purge import delete_tenant_runs

    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    training.forward_backward(DATA, "cross_entropy").result()
    key = f"acme/tinker/{training.model_id}"
    checkpoints = LocalCheckpoints(service.learner_settings.checkpoints_dir)
    assert checkpoints.entries(queue.run_checkpoint_name(key))               # created: checkpointed
    deleted = []
    real_step = service.work.backend.optim_step

    def delete_during_the_step(run, params):
        out = real_step(run, params)
        if run == key:
            service.registry.retire_tenant("acme")
            deleted.append(delete_tenant_runs(service.redis, "acme", checkpoints))
        return out

    monkeypatch.setattr(service.work.backend, "optim_step", delete_during_the_step)
    training.optim_step(ADAM)            # its answer never comes: the tenant is gone
    beta = tinker.ServiceClient(base_url=service.url, api_key=service.keys["beta"])
    other = beta.create_lora_training_client(base_model="tiny", rank=RANK).result()
    other.forward_backward(DATA, "cross_entropy").result()
    other.optim_step(ADAM).result()      # the learner went on past the deleted run's step
    assert deleted == [1]
    assert checkpoints.entries(queue.run_checkpoint_name(key)) == []
    assert [k for k in service.redis.scan_iter(match="clora:tinker:*") if b"acme" in k] == []
    assert not service.redis.hexists(queue.RUNS, key) and key not in service.work.runs

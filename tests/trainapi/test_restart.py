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
    assert learner.store.peek(key).step == 1          # the checkpoint holds the step
    service.start_learner(learner)
    out = pending.result()
    assert out.metrics["step:max"] == 1.0
    assert run_state(service, training.model_id)[0] == 1   # answered from the checkpoint, not stepped again

"""Tinker runs share the learner through its scheduler: a run is one more view, weighted and
prioritised as its tenant, and its requests interleave with a continuously learning tenant's steps
instead of running ahead of them or waiting behind them."""

from __future__ import annotations

import time

import pytest

tinker = pytest.importorskip("tinker")

from clora.ingest.buffers import ReplayBuffer  # noqa: E402
from clora.registry import LearningPolicy  # noqa: E402
from clora.trainapi import queue  # noqa: E402
from tests.learner.helpers import sft  # noqa: E402

from .conftest import RANK  # noqa: E402
from .test_sdk import sft_datum  # noqa: E402

DATA = [sft_datum([10, 11, 12], [40, 41, 42, 43])]


def queued(service, key: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while queue.waiting(service.redis, [key])[key] < n:
        assert time.monotonic() < deadline, f"{n} requests never reached the queue"
        time.sleep(0.02)


def test_a_run_is_scheduled_as_its_tenant_is_and_interleaves_with_continuous_training(service):
    service.registry.update_policy("acme", weight=3.0, priority=1)
    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    key = f"acme/tinker/{training.model_id}"
    service.stop_learner()   # from here the test ticks the learner itself

    # beta learns continuously: corrections waiting in its buffer
    service.registry.update_policy("beta", algorithm="sft", batch_size=2, min_new_examples=2, learning_rate=1e-3)
    buffer = ReplayBuffer(service.redis)
    for i in range(12):
        buffer.add_examples("beta", f"fb-{i}", [sft("beta", i, f"q{i}?", "a")], now=time.time())
    # acme's run: six forward_backward requests queued
    futures = [training.forward_backward(DATA, "cross_entropy") for _ in range(6)]
    queued(service, key, 6)

    learner = service.new_learner()
    views, registered = learner._open_tick()
    run_view = next(v for v in views if v.id == key)
    assert (run_view.weight, run_view.priority, run_view.waiting) == (3.0, 1, 6)
    assert not any(v.id == key for v in learner._views()[0])   # it is not a tenant of the buffers

    picks = [learner.tick() for _ in range(8)]
    assert key in picks[:3] and "beta" in picks[:3], picks      # neither waits behind the other
    assert picks.count(key) >= 4, picks                          # acme's weight 3 x priority 1 earns more
    assert "beta" in picks[4:] or queue.waiting(service.redis, [key])[key] == 0, picks
    service.start_learner(learner)
    assert all(f.result().metrics["loss:sum"] > 0 for f in futures)


def test_runs_share_one_metric_label_per_tenant():
    from prometheus_client import CollectorRegistry

    from clora.learner.external import metric_label
    from clora.learner.metrics import LearnerMetrics
    from clora.learner.scheduler import Scheduler, TenantView

    assert metric_label("acme") == "acme" and metric_label("acme/tinker/s1:train:0") == "acme/tinker"
    metrics = LearnerMetrics(CollectorRegistry())
    scheduler = Scheduler(metrics=metrics, label=metric_label)
    views = [TenantView(f"acme/tinker/s{i}:train:0", False, 1.0, 0, 1, 1) for i in range(5)]
    for _ in range(5):
        picked = scheduler.pick(views).tenant
        scheduler.record(picked, 0.1)
    labels = {s.labels.get("tenant") for m in metrics.step_seconds.collect() for s in m.samples}
    assert labels == {"acme/tinker"}

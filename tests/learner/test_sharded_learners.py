"""Two learners sharing the tenants (`clora.learner.leases`), each a `Learner` on the tiny model in
its own thread with its own folders, sharing only the real Redis (registry, buffers, leases) and
an S3-compatible store (versions and checkpoints: the suite's moto server).

Each tenant is trained by one learner. Then one learner dies abruptly (its thread stops between
ticks: no shutdown, no checkpoint, no release, as kill -9 leaves it), right after a step that no
checkpoint holds. The other takes its tenants within the lease TTL and a tick, resumes from the
newest checkpoint (written by the dead learner before its last publish), and publishes the next
version number. Counting the examples each step trained shows the invariant
(`clora.learner.process`): nothing is lost, and the only examples trained twice are those of the
dead learner's steps after its last checkpoint, whose weights died with it, unpublished; along
the weights that live on, every example is trained once."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
import torch

from clora.checkpoint_storage import open_checkpoint_storage
from clora.ingest.buffers import BufferPolicy, ReplayBuffer
from clora.registry import LearningPolicy, Registry
from clora.storage import open_storage
from clora.learner.base_model import load_base_model
from clora.learner.checkpoint import Checkpoints, tenant_checkpoint
from clora.learner.leases import RedisLeases
from clora.learner.process import Learner
from clora.learner.settings import LearnerSettings

from .helpers import sft

pytestmark = pytest.mark.integration

TTL_S = 2.0
BATCH = 2


class TheseTenants(Registry):
    """The registry, listing only this test's tenants (other tests' share the session's Redis)."""

    def __init__(self, client, ids: list[str]):
        super().__init__(client)
        self.ids = set(ids)

    def list_tenants(self):
        return [t for t in super().list_tenants() if t.id in self.ids]


def test_a_dead_learners_tenants_move_to_the_other_which_resumes_without_losing_or_repeating_examples(
        redis_client, s3_storage_settings, tiny_model_dir, tenant_id, tmp_path, wait_for):
    torch.set_num_threads(1)
    tenants = [f"{tenant_id}-{c}" for c in "xyz"]
    registry = TheseTenants(redis_client, tenants)
    policy = LearningPolicy(algorithm="sft", learning_rate=1e-2, batch_size=BATCH, min_new_examples=BATCH,
                            fresh_fraction=1.0, drift_tolerance=None, reward_guard=False, hacking_guard=False)
    for t in tenants:
        registry.create_tenant(t, policy=policy)
    writer = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fed = Counter()

    def feed(n: int) -> None:
        for t in tenants:
            for i in range(fed[t], fed[t] + n):
                writer.add_examples(t, f"fb-{t}-{i}", [sft(t, i, f"q{i}?", "blue")], now=time.time())
            fed[t] += n

    pool = f"test-{uuid.uuid4().hex[:8]}"
    trained: list[tuple[str, str, int, tuple[str, ...]]] = []     # (learner, tenant, step, example ids)
    learners: dict[str, Learner] = {}
    for name in ("a", "b"):
        settings = LearnerSettings(rank=4, alpha=8, max_seq_len=64, metrics_port=0,
                                   adapters_dir=tmp_path / name / "adapters", checkpoints_dir=tmp_path / name / "ckpt",
                                   publish_every=2, checkpoint_every=2,
                                   keep_versions=0, idle_sleep_s=0.05, lease_ttl_s=TTL_S, instance_id=name)
        model, tok = load_base_model(tiny_model_dir)
        lr = Learner(settings, model, tok, registry=registry, buffer=ReplayBuffer(redis_client),
                     announce=lambda e: None, base_model_name="tiny",
                     storage=open_storage(s3_storage_settings, settings.adapters_dir),
                     checkpoints=open_checkpoint_storage(s3_storage_settings, settings.checkpoints_dir),
                     leases=RedisLeases(redis_client, name, TTL_S, pool=pool))
        lr.leases.beat()                                  # both count before either takes a tenant
        _record_steps(lr, name, trained)
        learners[name] = lr

    steps = {t: 0 for t in tenants}
    a, b = learners["a"], learners["b"]
    stop, a_stopped = threading.Event(), threading.Event()
    died = {}

    def a_dies() -> bool:     # right after its tenants' 7th step, which no checkpoint holds
        if fed[tenants[0]] >= 14 and all(t in a.store and a.store.peek(t).step >= 7 for t in a.leases.fences):
            died["at"], died["held"] = time.monotonic(), sorted(a.leases.fences)
            return True
        return False

    b_ticks: list[float] = []         # how long each of b's ticks took (s)
    threads = [threading.Thread(target=_loop, args=(a, stop, a_dies, a_stopped, []), daemon=True),
               threading.Thread(target=_loop, args=(b, stop, lambda: False, threading.Event(), b_ticks), daemon=True)]
    for th in threads:
        th.start()
    try:
        # phase 1: 8 examples each -> 4 steps, v1 and v2; every tenant trained by one learner
        feed(8)
        wait_for(lambda: all(registry.live_version(t) == 2 for t in tenants), timeout=180, what="v2 of every tenant")
        by = {t: {who for who, tt, _, _ in trained if tt == t} for t in tenants}
        assert all(len(who) == 1 for who in by.values()), by
        held = {name: sorted(lr.leases.fences) for name, lr in learners.items()}
        assert sorted(len(v) for v in held.values()) == [1, 2] and sorted(held["a"] + held["b"]) == sorted(tenants)
        assert {t: next(iter(by[t])) for t in tenants} == {t: n for n, ts in held.items() for t in ts}

        # phase 2: 6 more -> steps 5, 6 (v3, checkpointed before it is published) and 7 (in memory only);
        # then a dies, holding its leases
        feed(6)
        assert a_stopped.wait(180), "a never finished its tenants' 7th step"
        orphans = died["held"]
        assert orphans == held["a"]
        wait_for(lambda: all(b.leases.holds(t) for t in orphans), timeout=TTL_S + 30, interval=0.02,
                 what="b holding a's tenants")
        took, tick = time.monotonic() - died["at"], max(b_ticks)
        assert took <= TTL_S + tick + 0.5, f"b took a's tenants {took:.2f} s after a died (bound: TTL {TTL_S} s + " \
                                           f"b's longest tick {tick:.2f} s)"

        # phase 3: 2 more -> b resumes a's tenants from their step-6 checkpoint, trains 13-16 (steps 7
        # and 8) and publishes v4
        feed(2)
        wait_for(lambda: all(registry.live_version(t) == 4 for t in tenants), timeout=180, what="v4 of every tenant")
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    b.shutdown()

    assert all(not b.leases.holds(t) for t in tenants)          # released at shutdown
    for t in tenants:
        versions = registry.adapter_versions(t)
        assert [v.version for v in versions] == [1, 2, 3, 4]             # none published twice
        assert [v.examples_seen for v in versions] == [4, 8, 12, 16]    # each holds the data before it
        assert [v.parent_version for v in versions] == [None, 1, 2, 3]
        ids = [f"{t}-{i}" for i in range(16)]
        runs = [(who, step, examples) for who, tt, step, examples in trained if tt == t]
        everything = Counter(e for _, _, examples in runs for e in examples)
        assert set(everything) == set(ids)                               # none lost
        if t in orphans:
            assert [(who, step) for who, step, _ in runs] == [("a", s) for s in range(1, 8)] + [("b", 7), ("b", 8)]
            died_with_a = [e for who, step, examples in runs if who == "a" and step == 7 for e in examples]
            assert sorted(e for e, n in everything.items() if n > 1) == sorted(died_with_a) == ids[12:14]
            lives_on = [e for who, step, examples in runs if (who, step) != ("a", 7) for e in examples]
            assert sorted(lives_on) == sorted(ids)                        # each once along the surviving weights
        else:
            assert [who for who, _, _ in runs] == ["b"] * 8 and all(n == 1 for n in everything.values())
        final = Checkpoints(open_checkpoint_storage(s3_storage_settings, tmp_path / "reader"),
                            b.model.layout.numel).load(tenant_checkpoint(t))
        assert (final.step, final.examples_seen, final.last_published_version) == (8, 16, 4)
        assert b.buffer.newer_than(t, "sft", final.cursor) == 0                # nothing left behind its cursor


def _record_steps(lr: Learner, name: str, trained: list) -> None:
    """Record every step `lr` trains: (learner, tenant, step, example ids)."""
    real = lr.trainer.train_step

    def step(tenant, examples, policy, prefetch=None):
        result = real(tenant, examples, policy, prefetch=prefetch)
        trained.append((name, tenant, result.step, tuple(e.example_id for e in examples)))
        return result
    lr.trainer.train_step = step


def _loop(lr: Learner, stop: threading.Event, dies, stopped: threading.Event, ticks: list[float]) -> None:
    """`run_forever`, except that `dies()` ends it as kill -9 would: no shutdown, nothing released.
    Each tick's duration, its idle wait included, goes to `ticks`."""
    try:
        while not stop.is_set():
            if dies():
                return
            t0 = time.monotonic()
            if lr.tick() is None:
                time.sleep(lr.s.idle_sleep_s)
            ticks.append(time.monotonic() - t0)
    finally:
        stopped.set()

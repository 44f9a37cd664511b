"""The learner loop: schedules, trains, publishes, checkpoints; resumes after a crash."""

from __future__ import annotations

import threading

import pytest
import torch

from clora.registry import LearningPolicy, Tenant
from clora.learner.backoff import Backoff
from clora.learner.base_model import load_base_model
from clora.learner.metrics import LearnerMetrics
from clora.learner.process import Learner

from .helpers import checkpointed_tenants, rl, sft


def _learner(world, tiny_model_dir, events, device: str = "cpu"):
    settings, reg, buf = world
    model, tok = load_base_model(tiny_model_dir, device=device)
    return Learner(settings, model, tok, registry=reg, buffer=buf, announce=events.append,
                   base_model_name=str(tiny_model_dir), metrics=LearnerMetrics(), device=device)


def test_loop_trains_publishes_and_checkpoints(world, tiny_model_dir):
    _, reg, _ = world
    events = []
    lr = _learner(world, tiny_model_dir, events)
    trained = [lr.tick() for _ in range(8)]
    # 12 examples / batch 4 = 3 fresh batches each; then fewer than min_new_examples: they wait
    assert trained.count("acme") == 3 and trained.count("beta") == 3 and trained[-2:] == [None, None]
    assert "idle" not in trained
    assert reg.live_version("acme") is not None and reg.live_version("beta") is not None
    acme = reg.adapter_versions("acme")
    assert [v.version for v in acme] == list(range(1, len(acme) + 1))
    assert all(v.eval_scores["eval_examples"] == 1.0 for v in acme)
    assert acme[-1].eval_scores["eval_loss"] < acme[0].eval_scores["eval_loss"]
    assert {e.tenant for e in events} == {"acme", "beta"} and all(e.action == "published" for e in events)
    assert checkpointed_tenants(world[0]) == ["acme", "beta"]
    m = lr.metrics.registry
    assert m.get_sample_value("clora_learner_steps_total", {"tenant": "acme", "algorithm": "sft"}) == 3
    assert m.get_sample_value("clora_learner_publishes_total", {"tenant": "beta", "outcome": "published"}) >= 1


def test_the_gate_reuses_the_live_versions_held_out_loss_until_it_changes(world, tiny_model_dir, monkeypatch):
    _, reg, _ = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner(world, tiny_model_dir, [])
    measured = []
    eval_loss, example_losses = lr.trainer.eval_loss, lr.trainer.example_losses
    monkeypatch.setattr(lr.trainer, "example_losses", lambda tenant, held, policy, weights=None: (
        measured.append("live" if weights is not None else "candidate"),
        example_losses(tenant, held, policy, weights))[1])
    while lr.tick() is not None:
        pass
    acme = reg.adapter_versions("acme")
    assert len(acme) >= 2 and "live" not in measured     # every live version was the candidate measured before it
    assert lr.metrics.registry.get_sample_value("clora_learner_gate_cache_hits_total", {"tenant": "acme"}) == \
        len(acme) - 1
    for parent, child in zip(acme, acme[1:]):
        assert child.eval_scores["live_eval_loss"] == parent.eval_scores["eval_loss"]
    held = lr.buffer.heldout("acme", "sft")
    policy = lr.policy(reg.tenants["acme"])
    # the reused number is what measuring the published adapter gives
    assert eval_loss("acme", held, policy, lr.publisher.live_weights("acme").flat) == \
        pytest.approx(acme[-1].eval_scores["eval_loss"], abs=1e-5)
    reg.set_live_version("acme", 1)                        # a rollback: the live version must be measured
    lr.gate.evaluate_and_publish("acme", policy)
    assert measured[-2:] == ["candidate", "live"]


def test_a_growing_held_out_set_measures_only_its_new_examples_under_the_live_version(world, tiny_model_dir,
                                                                                     monkeypatch):
    _, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner(world, tiny_model_dir, [])
    while lr.tick() is not None:
        pass
    policy = lr.policy(reg.tenants["acme"])
    live = lr.publisher.live_weights("acme")
    measured = []
    example_losses = lr.trainer.example_losses
    monkeypatch.setattr(lr.trainer, "example_losses", lambda tenant, examples, how, weights=None: (
        measured.append(sorted(e.example_id for e in examples)), example_losses(tenant, examples, how, weights))[1])
    for record in lr.tenants.values():                         # as after a restart: nothing known
        record.live_losses = None
    scored, how = lr.trainer.eval_examples(buf.heldout("acme", "sft"), policy)
    lr.gate.live_loss("acme", live, scored, how)
    assert measured == [sorted(e.example_id for e in scored)]  # everything, once
    for i in (200, 201):                                       # new traffic: two more held-out examples
        buf.add(sft("acme", i, f"q{i}?", "blue"), held_out=True)
    held = buf.heldout("acme", "sft")
    scored, how = lr.trainer.eval_examples(held, policy)
    before = lr.metrics.registry.get_sample_value("clora_learner_gate_live_examples_total", {"tenant": "acme"})
    got = lr.gate.live_loss("acme", live, scored, how)
    assert measured[-1] == ["acme-200", "acme-201"]            # the others came from the cache
    assert lr.metrics.registry.get_sample_value("clora_learner_gate_live_examples_total",
                                                {"tenant": "acme"}) == before + 2
    # the combined number is what measuring the live version on the whole set gives
    assert got == pytest.approx(lr.trainer.eval_loss("acme", held, policy, live.flat), abs=1e-6)


@pytest.mark.parametrize("on_policy", [True, False])
def test_rl_batches_are_on_policy_only_unless_configured(world, tiny_model_dir, on_policy):
    settings, reg, buf = world
    reg.tenants["rl"] = Tenant(id="rl", policy=LearningPolicy(algorithm="rl", learning_rate=1e-2, batch_size=8,
                                                               min_new_examples=2))
    reg.tenants["acme"].policy.paused = reg.tenants["beta"].policy.paused = True
    for i in range(8):
        buf.add(rl("rl", i, f"q{i // 4}?", "ab"[i % 2], float(i % 2), f"g{i // 4}"))
    points = []
    reg.append_metrics = lambda tenant, point: points.append(point)
    world = (settings.model_copy(update={"rl_on_policy": on_policy}), reg, buf)
    lr = _learner(world, tiny_model_dir, [])
    assert lr.tick() == "rl"
    for i in range(8, 11):                         # 3 new samples: fewer than a batch
        buf.add(rl("rl", i, "q2?", "ab"[i % 2], float(i % 2), "g2"))
    assert lr.tick() == "rl"
    examples = [p["examples"] for p in points if "loss" in p]
    # on-policy: only the 3 new samples; otherwise topped up to the batch size with replayed old ones
    assert examples == ([8, 3] if on_policy else [8, 8])


@pytest.mark.parametrize("fresh, expected", [(None, 0.5), (1.0, 1.0), (0.0, 0.0)])
def test_a_tenants_fresh_fraction_overrides_the_learners(world, tiny_model_dir, fresh, expected):
    settings, reg, buf = world
    reg.tenants["acme"].policy.fresh_fraction = fresh
    reg.tenants["beta"].policy.paused = True
    asked = []
    sample = buf.sample
    buf.sample = lambda *a, **kw: (asked.append(kw["fresh_fraction"]), sample(*a, **kw))[1]
    lr = _learner(world, tiny_model_dir, [])
    assert lr.tick() == "acme" and asked == [expected]


def test_an_rl_batch_without_a_reward_spread_is_consumed_without_a_step(world, tiny_model_dir):
    settings, reg, buf = world
    reg.tenants["rl"] = Tenant(id="rl", policy=LearningPolicy(algorithm="rl", learning_rate=1e-2, batch_size=8,
                                                               min_new_examples=2))
    reg.tenants["acme"].policy.paused = reg.tenants["beta"].policy.paused = True
    for i in range(8):                             # two groups, each all right or all wrong: advantage 0
        buf.add(rl("rl", i, f"q{i // 4}?", "a", float(i // 4), f"g{i // 4}"))
    lr = _learner(world, tiny_model_dir, [])
    assert lr.tick() is None
    st = lr.store.state("rl")
    weights = st.master.clone()
    # g0 consumed; g1, the newest group, waits in case more of it comes: not offered again either
    assert (st.step, st.cursor) == (0, 4) and lr.tick() is None
    assert lr.metrics.registry.get_sample_value("clora_learner_flat_batches_total", {"tenant": "rl"}) == 1
    for i in range(8, 12):                         # a group with a spread trains (with g1)
        buf.add(rl("rl", i, "q2?", "ab"[i % 2], float(i % 2), "g2"))
    assert lr.tick() == "rl" and lr.store.state("rl").step == 1 and lr.store.state("rl").cursor == 12
    assert not torch.equal(lr.store.state("rl").master, weights)


def test_a_flat_rl_batch_is_consumed_without_waiting_behind_another_tenants_step(world, tiny_model_dir):
    """A tenant whose batch has no reward spread needs no step, only a read: it must not wait
    in the queue while other tenants train (its next rollouts wait on it)."""
    _, reg, buf = world
    reg.tenants["acme"].policy.paused = reg.tenants["beta"].policy.paused = True
    for tid in ("a-spread", "z-flat"):
        reg.tenants[tid] = Tenant(id=tid, policy=LearningPolicy(algorithm="rl", learning_rate=1e-2, batch_size=4,
                                                                 min_new_examples=4))
    for i in range(4):
        buf.add(rl("a-spread", i, "q?", "ab"[i % 2], float(i % 2), "g"))
        buf.add(rl("z-flat", i, "q?", "a", 1.0, "g"))
    lr = _learner(world, tiny_model_dir, [])
    assert lr.tick() == "a-spread"                 # the scheduler picks a-spread (equal shares, id order) ...
    assert lr.store.state("z-flat").cursor == 4    # ... and z-flat's flat batch was consumed in the same tick
    m = lr.metrics.registry
    assert m.get_sample_value("clora_learner_flat_batches_total", {"tenant": "z-flat"}) == 1
    assert m.get_sample_value("clora_learner_steps_total", {"tenant": "z-flat", "algorithm": "rl"}) is None
    assert lr.tick() is None                       # nothing left for either


@pytest.mark.parametrize("late", [True, False], ids=["rest arrives after the first draw", "rest past the cut"])
def test_a_group_whose_rest_is_not_in_a_flat_batch_still_trains_on_its_spread(world, tiny_model_dir, late):
    """A step's two groups of 4: g0 all right, g1 with one wrong answer, its last. The learner
    sees g0 and g1's first two (all right: flat) before the rest of g1 is stored (batch size 8),
    or behind a batch size of 6. Consumed whole, g1's last two (fewer than `min_new_examples`)
    would wait for the next step's rollouts while those wait for a version from this step."""
    settings, reg, buf = world
    reg.tenants["rl"] = Tenant(id="rl", policy=LearningPolicy(algorithm="rl", learning_rate=1e-2,
                                                               batch_size=8 if late else 6, min_new_examples=4))
    reg.tenants["acme"].policy.paused = reg.tenants["beta"].policy.paused = True
    step = [rl("rl", i, f"q{i // 4}?", "ab"[i == 7], float(i != 7), f"g{i // 4}") for i in range(8)]
    for e in step[:6] if late else step:
        buf.add(e)
    lr = _learner(world, tiny_model_dir, [])
    if late:
        assert lr.tick() is None and lr.store.state("rl").cursor == 4     # g0 consumed, g1 waits for the rest
        for e in step[6:]:
            buf.add(e)
    assert lr.tick() == "rl"
    st = lr.store.state("rl")
    assert (st.step, st.cursor) == (1, 8) and reg.live_version("rl") == 1
    assert [p["examples"] for p in reg.history["rl"] if "loss" in p] == [4]    # g1, whole


def test_a_tenant_holding_a_flat_group_that_may_grow_is_not_offered_to_the_scheduler(world, tiny_model_dir):
    """`a-flat`'s batch is one flat group, short of a batch: nothing to consume, nothing to train.
    Offered to the scheduler, it would win every pick (its virtual time never grows) and acme
    would never train."""
    _, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    reg.tenants["a-flat"] = Tenant(id="a-flat", policy=LearningPolicy(algorithm="rl", learning_rate=1e-2,
                                                                       batch_size=8, min_new_examples=4))
    for i in range(4):
        buf.add(rl("a-flat", i, "q?", "a", 1.0, "g"))
    lr = _learner(world, tiny_model_dir, [])
    assert [lr.tick() for _ in range(3)] == ["acme"] * 3
    assert lr.store.state("a-flat").cursor == 0    # held, not consumed: the rest of g may still come
    buf.add(rl("a-flat", 4, "q2?", "a", 1.0, "g2"))
    assert lr.tick() is None and lr.store.state("a-flat").cursor == 4   # g is followed by g2: it was whole


def test_resume_after_crash_continues_from_checkpoint_without_reusing_versions(world, tiny_model_dir):
    settings, reg, buf = world
    events = []
    first = _learner(world, tiny_model_dir, events)
    while "acme" not in first.store or first.store.peek("acme").step < 1:
        first.tick()
    acme_before = first.store.state("acme")
    snapshot = (acme_before.buffer.clone(), acme_before.step, acme_before.cursor)
    last_version = reg.live_version("acme")
    # crash: no shutdown, no flush, a checkpoint half-written. A new process starts from the same
    # folders and registry.
    torn = settings.checkpoints_dir / ".tmp-acme-0badc0de.safetensors"
    torn.write_bytes(b"\0" * 1024)
    second = _learner(world, tiny_model_dir, events)
    assert not torn.exists()
    assert second.lifecycle.admit(reg.get_tenant("acme"))     # loaded from its newest checkpoint
    restored = second.store.state("acme")
    assert torch.equal(restored.buffer, snapshot[0]) and (restored.step, restored.cursor) == snapshot[1:]
    while second.tick() is not None:
        pass
    versions = [v.version for v in reg.adapter_versions("acme")]
    assert versions == sorted(set(versions)) and max(versions) > last_version
    assert second.store.state("acme").step == 3  # 12 examples, batch 4: nothing trained twice


def test_an_operators_rollback_is_trained_on_from_not_published_over(world, tiny_model_dir):
    """`clora tenant rollback` changes only the registry. The learner must train on from the
    version made live, or its next publish would put the abandoned weights' descendant live."""
    _, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner(world, tiny_model_dir, [])
    while lr.tick() is not None:
        pass
    assert reg.live_version("acme") == 3
    reg.set_live_version("acme", 1)                 # the operator's rollback
    v1 = lr.publisher.weights("acme", 1)
    started_from = []
    train_step = lr.trainer.train_step
    lr.trainer.train_step = lambda tid, *a, **kw: (started_from.append(lr.store.peek(tid).master.clone()),
                                                   train_step(tid, *a, **kw))[1]
    for i in range(100, 104):
        buf.add(sft("acme", i, f"q{i}?", "blue"))
    assert lr.tick() == "acme"
    assert torch.allclose(started_from[0], v1, atol=1e-6)
    newest = reg.adapter_versions("acme")[-1]
    assert newest.version == 4 and newest.parent_version == 1 and reg.live_version("acme") == 4
    assert lr.store.peek("acme").last_published_version == 4  # followed once, not on every step


def test_a_failing_step_backs_its_tenant_off_while_the_others_train(world, tiny_model_dir):
    lr = _learner(world, tiny_model_dir, [])
    train_step = lr.trainer.train_step

    def broken_for_acme(tid, *a, **kw):
        if tid == "acme":
            raise FloatingPointError("non-finite gradient")
        return train_step(tid, *a, **kw)

    lr.trainer.train_step = broken_for_acme
    trained = [lr.tick() for _ in range(6)]
    assert trained.count("beta") == 3 and "acme" not in trained        # beta trains on, acme waits
    m = lr.metrics.registry
    assert m.get_sample_value("clora_learner_failures_total", {"tenant": "acme"}) == 1  # tried once: backed off
    assert lr.store.peek("acme").cursor == 0                          # its batch was not skipped
    failed = [p for p in lr.registry.history["acme"] if "failed" in p]   # for the console
    assert failed == [{"failed": "FloatingPointError: non-finite gradient", "failures": 1, "retry_in_s": 5.0}]
    lr.trainer.train_step = train_step
    lr.tenants["acme"].backoff = Backoff(failures=1, wait_s=5.0, retry_at=0.0)   # the back-off is over
    assert [lr.tick() for _ in range(3)] == ["acme"] * 3 and lr.tenants["acme"].backoff is None


def test_a_tenant_deleted_during_its_step_is_dropped_not_backed_off(world, tiny_model_dir):
    """Deleting a tenant retires it in the registry first, so its step's version claim is refused
    (`TenantNotFound`): the learner forgets it, counts no failure, and trains the others on."""
    from clora.registry import TenantNotFound

    _, reg, _ = world
    lr = _learner(world, tiny_model_dir, [])
    claim = reg.claim_version

    def retired_acme(tenant_id, *a, **kw):
        if tenant_id == "acme":
            del reg.tenants["acme"]
            raise TenantNotFound("claiming acme's version 1: tenant 'acme' is being deleted or gone")
        return claim(tenant_id, *a, **kw)

    reg.claim_version = retired_acme
    trained = [lr.tick() for _ in range(5)]
    assert "acme" not in lr.store and "acme" not in lr.tenants
    assert trained.count("beta") == 3 and trained.count("acme") <= 1
    assert lr.metrics.registry.get_sample_value("clora_learner_failures_total", {"tenant": "acme"}) is None
    assert not any("failed" in p for p in reg.history.get("acme", []))


def test_publishing_survives_a_broker_outage_and_an_unreadable_live_version(world, tiny_model_dir):
    """The registry holds a version before it is announced (serving polls it); and a live
    folder someone deleted is gated as if nothing were live, not a crash on every step."""
    import shutil

    from clora.ingest.producer import BrokerUnavailable

    _, reg, _ = world
    reg.tenants["beta"].policy.paused = True

    def down(event):
        raise BrokerUnavailable("broker did not acknowledge")

    lr = _learner(world, tiny_model_dir, [])
    lr.publisher.announce = down
    assert lr.tick() == "acme" and reg.live_version("acme") == 1
    shutil.rmtree(lr.publisher.tenant_dir("acme") / "v1")
    assert lr.tick() == "acme" and reg.live_version("acme") == 2


def test_the_learner_keeps_only_its_newest_versions(world, tiny_model_dir):
    settings, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner((settings.model_copy(update={"keep_versions": 1}), reg, buf), tiny_model_dir, [])
    while lr.tick() is not None:
        pass
    # the newest one, live, and its parent (where the reward guard would roll back to)
    assert [v.version for v in reg.adapter_versions("acme")] == [2, 3] and reg.live_version("acme") == 3
    assert lr.publisher.versions_on_disk("acme") == [2, 3]


def test_run_forever_stops_gracefully(world, tiny_model_dir):
    events = []
    lr = _learner(world, tiny_model_dir, events)
    stop = threading.Event()
    t = threading.Thread(target=lr.run_forever, args=(stop,))
    t.start()
    for _ in range(600):
        if len(events) >= 6:
            break
        threading.Event().wait(0.05)
    stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(checkpointed_tenants(world[0])) >= 2

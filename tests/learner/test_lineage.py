"""Each published version's lineage: the feedback events first trained in it (fresh examples,
never replays), with their accept times, capped, kept across a learner restart until the
version that holds them is published, and empty again after each publish."""

from __future__ import annotations

import pytest

from clora.registry import LearningPolicy, Tenant
from clora.learner.base_model import load_base_model
from clora.learner.metrics import LearnerMetrics
from clora.learner.process import Learner

from .helpers import checkpointed, sft


def _learner(settings, reg, buf, tiny_model_dir) -> Learner:
    model, tok = load_base_model(tiny_model_dir)
    return Learner(settings, model, tok, registry=reg, buffer=buf, announce=lambda event: None,
                   base_model_name=str(tiny_model_dir), metrics=LearnerMetrics())


@pytest.fixture
def fresh_world(world):
    """`world` with acme and beta paused and a tenant `news` (SFT, batch 4, one new example
    enough) whose 6 corrections were accepted at 1000.0 + i."""
    settings, reg, buf = world
    reg.tenants["acme"].policy.paused = reg.tenants["beta"].policy.paused = True
    reg.tenants["news"] = Tenant(id="news", policy=LearningPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4,
                                                                   min_new_examples=1))
    for i in range(6):
        buf.add(sft("news", i, f"q{i}?", "blue").model_copy(update={"accepted_at": 1000.0 + i}))
    return settings, reg, buf


def test_a_version_lists_the_events_first_trained_in_it_not_those_it_replays(fresh_world, tiny_model_dir):
    settings, reg, buf = fresh_world
    lr = _learner(settings, reg, buf, tiny_model_dir)
    assert lr.tick() == "news"                     # 4 new examples -> v1
    assert lr.tick() == "news"                     # the 2 left, and 2 replayed to fill the batch -> v2
    assert [v.version for v in reg.adapter_versions("news")] == [1, 2]
    assert reg.lineage("news", 1).accepted_at == {f"fb-{i}": 1000.0 + i for i in range(4)}
    assert reg.lineage("news", 2).accepted_at == {"fb-4": 1004.0, "fb-5": 1005.0}
    assert lr.store.peek("news").lineage is None   # the next version's lineage starts empty


def test_past_its_cap_a_lineage_counts_events_without_listing_them(fresh_world, tiny_model_dir):
    settings, reg, buf = fresh_world
    lr = _learner(settings.model_copy(update={"lineage_max_events": 3}), reg, buf, tiny_model_dir)
    assert lr.tick() == "news"
    lineage = reg.lineage("news", 1)
    assert len(lineage.accepted_at) == 3 and lineage.over_cap == 1 and lineage.events == 4


def test_a_restarted_learner_keeps_the_lineage_of_the_version_it_has_not_published_yet(fresh_world, tiny_model_dir):
    settings, reg, buf = fresh_world
    settings = settings.model_copy(update={"publish_every": 2})
    first = _learner(settings, reg, buf, tiny_model_dir)
    assert first.tick() == "news" and reg.adapter_versions("news") == []     # step 1: no publish yet
    pending = checkpointed(settings, "news", first.store.layout.numel).lineage
    assert pending is not None and set(pending.accepted_at) == {f"fb-{i}" for i in range(4)}

    second = _learner(settings, reg, buf, tiny_model_dir)                     # the first one crashed
    assert second.tick() == "news"                                            # step 2 publishes v1
    assert reg.lineage("news", 1).accepted_at == {f"fb-{i}": 1000.0 + i for i in range(6)}
    saved = checkpointed(settings, "news", second.store.layout.numel)
    assert saved.lineage is None and saved.last_published_version == 1


def test_events_of_a_candidate_the_gate_refused_go_to_the_next_published_version(fresh_world, tiny_model_dir,
                                                                                 monkeypatch):
    from clora.learner import gate

    settings, reg, buf = fresh_world
    lr = _learner(settings, reg, buf, tiny_model_dir)
    refuse_once = iter([gate.GateDecision(False, 1.0, 0.5, 0.02, "refused for the test")])
    monkeypatch.setattr(gate, "decide", lambda *a, **kw: next(refuse_once, gate.GateDecision(True, 0.5, None, 0.02,
                                                                                            "allowed")))
    buf.add(sft("news", 50, "held?", "blue"), held_out=True)                  # the gate decides only with some
    assert lr.tick() == "news" and reg.adapter_versions("news") == []
    assert lr.tick() == "news"
    assert reg.lineage("news", 1).accepted_at == {f"fb-{i}": 1000.0 + i for i in range(6)}

"""The reward guard: the decision on per-version reward tallies, and the learner rolling a
live version back and training on from the restored version's weights."""

from __future__ import annotations

import pytest
import torch

from clora.ingest.buffers import RewardTally
from clora.learner.adapter_store import EXP_AVG, EXP_AVG_SQ, MASTER
from clora.learner.reward_guard import GuardSettings, judge

from .helpers import rl, sft
from .test_process import _learner

SETTINGS = GuardSettings(min_samples=12, margin=0.1, z=2.5)


def tally(rewards: list[float]) -> RewardTally:
    return RewardTally(len(rewards), sum(rewards), sum(r * r for r in rewards))


def bernoulli(n: int, ones: int) -> RewardTally:
    return tally([1.0] * ones + [0.0] * (n - ones))


CHAIN = {1: None, 2: 1, 3: 2, 4: 3}
"""v4's parent is v3, whose parent is v2, ..."""


def test_a_clear_drop_against_the_parent_rolls_back():
    v = judge(4, CHAIN, {3: bernoulli(40, 32), 4: bernoulli(12, 3)}, SETTINGS)   # 0.80 -> 0.25
    assert v.rollback and v.reference == 3
    assert v.summary() == {"reference": 3, "reason": v.reason, "live_reward": 0.25, "live_samples": 12,
                           "reference_reward": 0.8, "reference_samples": 40}
    assert "3.8 standard errors" in v.reason


@pytest.mark.parametrize("tallies, why", [
    ({3: bernoulli(40, 32), 4: bernoulli(11, 0)}, "has 11 scored samples, needs 12"),      # too few yet
    ({3: bernoulli(40, 32), 4: bernoulli(12, 8)}, "standard errors"),                      # 0.8 -> 0.67: noise
    ({3: bernoulli(4000, 3200), 4: bernoulli(4000, 2880)}, "drop 0.080"),                # significant, tiny
    ({3: bernoulli(40, 20), 4: bernoulli(12, 12)}, "drop -0.500"),                       # better
    ({None: bernoulli(40, 40), 3: bernoulli(3, 3), 4: bernoulli(12, 0)}, "no ancestor of v4"),
])                                                  # the base model is never a reference; v3 lived too briefly
def test_no_rollback_without_a_measured_meaningful_drop(tallies, why):
    v = judge(4, CHAIN, tallies, SETTINGS)
    assert not v.rollback and why in v.reason


def test_the_reference_is_the_newest_ancestor_with_enough_samples():
    # v3 lived too briefly to be judged: v4 is compared with v2 (and v1 is older than v2)
    tallies = {1: bernoulli(50, 10), 2: bernoulli(30, 27), 3: bernoulli(5, 0), 4: bernoulli(12, 4)}
    v = judge(4, CHAIN, tallies, SETTINGS)
    assert v.reference == 2 and v.rollback
    assert not judge(4, CHAIN, tallies | {2: bernoulli(11, 11)}, SETTINGS).rollback   # v2 short too: v1 (0.2)


def test_constant_rewards_roll_back_on_the_margin_alone():
    assert judge(2, CHAIN, {1: tally([1.0] * 12), 2: tally([0.5] * 12)}, SETTINGS).rollback
    assert not judge(2, CHAIN, {1: tally([1.0] * 12), 2: tally([0.95] * 12)}, SETTINGS).rollback
    assert not judge(2, CHAIN, {1: tally([1.0] * 12), 2: tally([1.0] * 12)}, SETTINGS).rollback


def test_a_lineage_loop_does_not_hang():
    assert not judge(2, {1: 2, 2: 1}, {2: bernoulli(12, 0)}, SETTINGS).rollback


# --- in the learner ---------------------------------------------------------------------------

def _served(buf, tenant: str, version: int, rewards: list[float], start: int) -> None:
    for i, r in enumerate(rewards):
        buf.add(rl(tenant, start + i, f"q{start + i}?", "x", r, f"g{start + i}", adapter_version=version))


def _three_versions(world, tiny_model_dir, mode: str, events: list, **settings_update):
    settings, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    if mode == "fused":
        settings_update |= {"training_mode": "fused", "fused_max_tenants": 2}
    settings = settings.model_copy(update=settings_update)
    lr = _learner((settings, reg, buf), tiny_model_dir, events)
    while lr.tick() is not None:
        pass
    assert [v.version for v in reg.adapter_versions("acme")] == [1, 2, 3] and reg.live_version("acme") == 3
    return lr


@pytest.mark.parametrize("mode", ["serial", "fused"])
def test_the_learner_rolls_a_worse_live_version_back_and_trains_on_from_the_restored_one(world, tiny_model_dir,
                                                                                        mode):
    _, reg, buf = world
    events = []
    lr = _three_versions(world, tiny_model_dir, mode, events)
    before = lr.store.state("acme")
    step, exp_avg_sq = before.step, before.buffer[EXP_AVG_SQ].clone()
    _served(buf, "acme", 2, [1.0] * 11 + [0.0], 100)        # v2 earned 0.92 ...
    _served(buf, "acme", 3, [0.0] * 10 + [1.0] * 2, 200)    # ... v3 earns 0.17
    acme = reg.tenants["acme"]

    verdict = lr.rollback.guard(acme)
    assert verdict.rollback and verdict.reference == 2
    assert reg.live_version("acme") == 2
    assert events[-1].action == "rolled_back" and events[-1].version == 2
    note = reg.versions["acme"][3].rolled_back
    assert note["to"] == 2 and note["live_samples"] == 12 and note["reference_reward"] == pytest.approx(11 / 12)
    assert lr.metrics.registry.get_sample_value("clora_learner_reward_rollbacks_total", {"tenant": "acme"}) == 1
    # training goes on from v2's weights: momentum cleared, second moments and step kept
    st = lr.store.state("acme")
    assert torch.equal(st.buffer[MASTER], lr.publisher.weights("acme", 2))
    assert not st.buffer[EXP_AVG].any() and torch.equal(st.buffer[EXP_AVG_SQ], exp_avg_sq) and st.step == step
    if lr.fused is not None:
        assert lr.fused.slots.slot_of("acme") is None        # the stale fused copy is gone
    # v2's own parent (v1) served nothing: nothing to compare with, no second rollback
    again = lr.rollback.guard(acme)
    assert not again.rollback and reg.live_version("acme") == 2
    # an operator who makes v3 live again overrules the guard
    reg.set_live_version("acme", 3)
    overruled = lr.rollback.guard(acme)
    assert not overruled.rollback and "made live again" in overruled.reason and reg.live_version("acme") == 3
    reg.set_live_version("acme", 2)

    for i in range(4):
        buf.add(sft("acme", 300 + i, f"q{300 + i}?", "blue"))
    assert lr.tick() == "acme"
    assert reg.live_version("acme") == 4 and reg.versions["acme"][4].parent_version == 2
    assert not torch.equal(lr.publisher.weights("acme", 4), lr.publisher.weights("acme", 3))


def test_a_tenant_can_turn_the_guard_off(world, tiny_model_dir):
    _, reg, buf = world
    lr = _three_versions(world, tiny_model_dir, "serial", [])
    _served(buf, "acme", 2, [1.0] * 12, 100)
    _served(buf, "acme", 3, [0.0] * 12, 200)
    reg.tenants["acme"].policy.reward_guard = False
    assert lr.rollback.guard(reg.tenants["acme"]) is None and reg.live_version("acme") == 3


def test_the_loop_guards_every_unpaused_tenant_even_with_nothing_to_train(world, tiny_model_dir):
    _, reg, buf = world
    lr = _three_versions(world, tiny_model_dir, "serial", [], reward_guard_interval_s=0.0)
    _served(buf, "acme", 2, [1.0] * 12, 100)
    _served(buf, "acme", 3, [0.0] * 12, 200)
    reg.tenants["acme"].policy.paused = True      # an operator holding the tenant still: left alone
    assert lr.tick() is None and reg.live_version("acme") == 3
    reg.tenants["acme"].policy.paused = False
    assert lr.tick() is None                      # no SFT data waiting, yet the guard ran
    assert reg.live_version("acme") == 2 and reg.versions["acme"][3].rolled_back["to"] == 2

"""The reward-hacking guard: the decision on per-version rewards and served-reply signals, and
the learner pausing a tenant, rolling it back and raising an alert while the others train on."""

from __future__ import annotations

import pytest

from clora.ingest.signals import ReplyTraits, ServedSignals
from clora.learner.hacking_guard import HackingSettings, judge

from .helpers import sft
from .test_reward_guard import CHAIN, _served, _three_versions, bernoulli

SETTINGS = HackingSettings(min_samples=12, min_replies=20, reward_margin=0.1, empty_rise=0.2, bad_tool_call_rise=0.2,
                           length_factor=10.0, diversity_fraction=0.5, z=2.5)


def signals(n: int = 40, empty: int = 0, bad: int = 0, length: float = 60.0, spread: float = 10.0,
            distinct: int | None = None, prompts: int = 0) -> ServedSignals:
    """n replies, `empty` of them empty, `bad` with an unparseable tool call, mean `length` with
    standard deviation about `spread`, `distinct` different ones (default: all)."""
    chars = round(n * length)
    return ServedSignals(n=n, empty=empty, tool_calls=bad, bad_tool_calls=bad, chars=chars,
                         chars_sq=round(chars * chars / n + (n - 1) * spread * spread),
                         distinct=n if distinct is None else distinct, prompts=prompts)


HEALTHY = signals()
REWARDS = {3: bernoulli(20, 8), 4: bernoulli(15, 13)}       # 0.40 -> 0.87: the reward rose


def test_the_docstring_example_trips_on_three_signals():
    v = judge(4, CHAIN, {3: bernoulli(20, 8), 4: bernoulli(15, 13)},
              {3: signals(40, empty=2, length=60, distinct=38), 4: signals(30, empty=21, length=3, spread=2,
                                                                          distinct=4)}, SETTINGS)
    assert v.trip and v.reference == 3 and v.degraded == ("empty", "length", "diversity")
    assert "empty replies 0.05 -> 0.70" in v.reason and "mean length 60.0 -> 3.0" in v.reason
    summary = v.summary()
    assert summary["live_signals"]["empty_rate"] == 0.7 and summary["reference_reward"] == 0.4


@pytest.mark.parametrize("live, degraded", [
    (signals(empty=12), "empty"),                              # 0 -> 0.30
    (signals(bad=10), "bad_tool_calls"),                       # 0 -> 0.25
    (signals(length=5, spread=3), "length"),                   # 60 -> 5 characters
    (signals(length=700, spread=50), "length"),                # a blow-up
    (signals(distinct=15), "diversity"),                       # 40 -> 15 distinct of 40
])
def test_each_signal_alone_trips_when_the_reward_rose(live, degraded):
    v = judge(4, CHAIN, REWARDS, {3: HEALTHY, 4: live}, SETTINGS)
    assert v.trip and v.degraded == (degraded,)


@pytest.mark.parametrize("live", [
    signals(empty=6),                     # 0.15: under the 0.2 rise
    signals(length=10, spread=5),         # a sixth of the length: within the factor 10
    signals(distinct=24),                 # 0.6 of the reference's diversity
    signals(length=60, spread=10),        # the same
])
def test_signals_within_their_thresholds_do_not_trip(live):
    v = judge(4, CHAIN, REWARDS, {3: HEALTHY, 4: live}, SETTINGS)
    assert not v.trip and "did not degenerate" in v.reason


def test_a_rise_within_noise_does_not_trip():
    # 1 of 20 empty -> 6 of 20: +0.25, but 2.1 standard errors
    v = judge(4, CHAIN, REWARDS, {3: signals(20, empty=1), 4: signals(20, empty=6)}, SETTINGS)
    assert not v.trip


def test_no_trip_when_the_reward_fell_that_is_the_reward_guards_call():
    v = judge(4, CHAIN, {3: bernoulli(20, 16), 4: bernoulli(15, 3)}, {3: HEALTHY, 4: signals(empty=30)}, SETTINGS)
    assert not v.trip and "the reward fell" in v.reason
    # a drop within the margin still counts as "did not fall"
    assert judge(4, CHAIN, {3: bernoulli(20, 16), 4: bernoulli(20, 15)}, {3: HEALTHY, 4: signals(empty=30)},
                 SETTINGS).trip


@pytest.mark.parametrize("tallies, served, why", [
    ({3: bernoulli(20, 8), 4: bernoulli(11, 11)}, {3: HEALTHY, 4: signals(empty=30)}, "has 11 scored samples"),
    (REWARDS, {3: HEALTHY, 4: signals(19, empty=19)}, "19 replies"),
    (REWARDS, {3: signals(19), 4: signals(empty=30)}, "no ancestor of v4"),           # v3 served too little
    ({2: bernoulli(20, 8), 3: bernoulli(11, 0), 4: bernoulli(15, 13)},
     {3: HEALTHY, 4: signals(empty=30)}, "no ancestor of v4"),                         # v2 served nothing
    ({None: bernoulli(40, 0), 4: bernoulli(15, 13)}, {None: HEALTHY, 4: signals(empty=30)}, "no ancestor"),
])
def test_both_versions_need_their_samples_and_replies(tallies, served, why):
    v = judge(4, CHAIN, tallies, served, SETTINGS)
    assert not v.trip and why in v.reason


def test_a_slide_is_caught_against_the_last_version_before_it():
    """v3 collapsed and was measured, but was never judged (say, v4 went live first); v4 is as
    degenerate as v3, so beside v3 it looks fine, and beside v2 it does not."""
    tallies = {2: bernoulli(20, 8), 3: bernoulli(20, 18), 4: bernoulli(15, 14)}
    served = {2: HEALTHY, 3: signals(empty=36), 4: signals(empty=37)}
    v = judge(4, CHAIN, tallies, served, SETTINGS)
    assert v.trip and v.reference == 2 and v.degraded[0] == "empty"


def test_a_lineage_loop_does_not_hang():
    assert not judge(2, {1: 2, 2: 1}, {1: bernoulli(20, 8), 2: bernoulli(20, 8)}, {1: HEALTHY, 2: HEALTHY},
                     SETTINGS).trip


def test_the_reference_is_the_newest_ancestor_measured_in_both():
    tallies = {2: bernoulli(20, 8), 3: bernoulli(20, 8), 4: bernoulli(15, 13)}
    v = judge(4, CHAIN, tallies, {2: HEALTHY, 3: signals(5), 4: signals(empty=30)}, SETTINGS)
    assert v.trip and v.reference == 2


# --- in the learner ---------------------------------------------------------------------------

def _replies(buf, tenant: str, version: int, n: int, text) -> None:
    """`n` replies of `version`: `text(i)` each."""
    from clora.ingest.schemas import InteractionEvent

    for i in range(n):
        ix = InteractionEvent(tenant=tenant, interaction_id=f"i{version}-{i}", adapter_version=version,
                              messages=[{"role": "user", "content": f"q{i}"}],
                              response={"role": "assistant", "content": text(i)})
        buf.serve(tenant, ReplyTraits.of(ix))


def _hacked(world, tiny_model_dir):
    """acme at v3 (parent v2): v2 answered in full and earned 0.25, v3 answers empty and earns 1.0."""
    _, reg, buf = world
    lr = _three_versions(world, tiny_model_dir, "serial", [], reward_guard_interval_s=0.0)
    _served(buf, "acme", 2, [1.0] * 3 + [0.0] * 9, 100)
    _served(buf, "acme", 3, [1.0] * 12, 200)
    _replies(buf, "acme", 2, 20, lambda i: f"The answer to question {i} is blue.")
    _replies(buf, "acme", 3, 20, lambda i: "")
    return lr


def test_the_learner_pauses_rolls_back_and_alerts_while_others_train_on(world, tiny_model_dir):
    _, reg, buf = world
    lr = _hacked(world, tiny_model_dir)
    reg.tenants["beta"].policy.paused = False          # beta trains on
    assert lr.tick() is not None                       # the guards' round ran first
    acme = reg.tenants["acme"].policy
    assert acme.paused and acme.paused_reason.startswith("reward hacking: v3 was rolled back to v2")
    assert reg.live_version("acme") == 2
    note = reg.versions["acme"][3].rolled_back
    assert note["guard"] == "reward_hacking" and note["to"] == 2 and note["degraded"] == ["empty", "length",
                                                                                          "diversity"]
    (alert,) = reg.alerts("acme")
    assert alert.kind == "reward_hacking" and alert.version == 3 and alert.rolled_back_to == 2
    assert alert.facts["live_signals"]["empty_rate"] == 1.0
    m = lr.metrics.registry
    assert m.get_sample_value("clora_learner_reward_hacking_total", {"tenant": "acme"}) == 1
    assert m.get_sample_value("clora_learner_reward_rollbacks_total", {"tenant": "acme"}) is None
    marks = [p for p in reg.history["acme"] if "rolled_back" in p]
    assert [(p["rolled_back"], p["live"], p["guard"]) for p in marks] == [(3, 2, "reward_hacking")]
    # paused: acme trains no more though corrections wait; beta does
    for i in range(4):
        buf.add(sft("acme", 300 + i, f"q{300 + i}?", "blue"))
    trained = {lr.tick() for _ in range(3)}
    assert "acme" not in trained and "beta" in trained
    assert reg.live_version("acme") == 2


def test_a_tenant_the_guard_pauses_takes_no_step_in_that_tick(world, tiny_model_dir):
    _, reg, buf = world
    lr = _hacked(world, tiny_model_dir)
    reg.tenants["beta"].policy.paused = True
    for i in range(4):                                  # acme has a batch waiting when the guard trips
        buf.add(sft("acme", 400 + i, f"q{400 + i}?", "blue"))
    step = lr.store.peek("acme").step
    assert lr.tick() is None                           # the round paused acme before anyone was picked
    assert reg.tenants["acme"].policy.paused and lr.store.peek("acme").step == step
    assert reg.live_version("acme") == 2


def test_a_tenant_can_turn_the_hacking_guard_off(world, tiny_model_dir):
    _, reg, _ = world
    lr = _hacked(world, tiny_model_dir)
    reg.tenants["acme"].policy.hacking_guard = False
    assert lr.rollback.guard_hacking(reg.tenants["acme"]) is None
    lr.rollback.round(reg.tenants)
    assert reg.live_version("acme") == 3 and not reg.tenants["acme"].policy.paused


def test_a_version_an_operator_made_live_again_is_left_alone(world, tiny_model_dir):
    _, reg, _ = world
    lr = _hacked(world, tiny_model_dir)
    assert lr.rollback.guard_hacking(reg.tenants["acme"]).trip and reg.live_version("acme") == 2
    reg.update_policy("acme", paused=False)            # an operator resumes, and makes v3 live again
    assert reg.tenants["acme"].policy.paused_reason is None
    reg.set_live_version("acme", 3)
    again = lr.rollback.guard_hacking(reg.tenants["acme"])
    assert not again.trip and "made live again" in again.reason and reg.live_version("acme") == 3


def test_a_policy_that_answers_each_groups_episodes_alike_is_not_degenerate():
    """RL sends each prompt to a group: a version that learned the task gives a group's 8
    episodes one answer (4 prompts, 4 distinct replies among 32), where its ancestor gave each
    its own. Per prompt that is no loss of diversity; one answer to every prompt is."""
    learned = signals(32, distinct=4, prompts=4)
    assert learned.diversity == 1.0
    assert not judge(4, CHAIN, REWARDS, {3: signals(32, distinct=30, prompts=4), 4: learned}, SETTINGS).trip
    same_to_all = judge(4, CHAIN, REWARDS, {3: signals(32, distinct=30, prompts=4),
                                             4: signals(32, distinct=1, prompts=4)}, SETTINGS)
    assert same_to_all.trip and same_to_all.degraded == ("diversity",)

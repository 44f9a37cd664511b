"""The scheduler's fairness over training tokens (issue 21): a tenant offering 10x the examples
of another gets no more training once both want more than their share, and a step recorded with
its tokens is charged those tokens, not its seconds. Counted in steps and tokens, not timed."""

from __future__ import annotations

from collections import Counter

from clora.learner.scheduler import Scheduler, TenantView


def view(t, waiting, weight=1.0):
    return TenantView(t, False, weight, 0, 1, waiting)


def _backlogged(s: Scheduler, steps: int) -> Counter:
    """heavy and light both backlogged, heavy with 10x light's waiting examples, growing."""
    picks = Counter()
    for i in range(steps):
        light = 100 + i
        d = s.pick([view("heavy", 10 * light), view("light", light)])
        picks[d.tenant] += 1
        s.record(d.tenant, 1.0)
    return picks


def test_ten_times_the_waiting_examples_earn_no_more_steps_once_both_are_backlogged():
    picks = _backlogged(Scheduler(), 400)
    assert abs(picks["heavy"] - picks["light"]) <= 1, picks


def test_without_the_cap_the_larger_backlog_takes_more():
    picks = _backlogged(Scheduler(full_backlog=None), 400)
    assert picks["heavy"] > 1.2 * picks["light"], picks


def test_a_step_recorded_with_tokens_is_charged_its_tokens_not_its_seconds():
    """small's steps train 100 tokens in 2.0 s (mostly fixed cost), big's 400 in 2.5 s: equal
    weights share tokens, so small takes ~4 steps for each of big's."""
    s = Scheduler()
    cost = {"small": (2.0, 100), "big": (2.5, 400)}
    tokens = Counter()
    for _ in range(500):
        d = s.pick([view("small", 1000), view("big", 1000)])
        seconds, n = cost[d.tenant]
        tokens[d.tenant] += n
        s.record(d.tenant, seconds, tokens=n)
    assert abs(tokens["small"] - tokens["big"]) <= 0.03 * tokens["big"], tokens  # the running rate moves a little


def test_charged_by_seconds_the_tenant_with_small_steps_gets_fewer_tokens():
    s = Scheduler()
    cost = {"small": (2.0, 100), "big": (2.5, 400)}
    tokens = Counter()
    for _ in range(500):
        d = s.pick([view("small", 1000), view("big", 1000)])
        seconds, n = cost[d.tenant]
        tokens[d.tenant] += n
        s.record(d.tenant, seconds)
    assert tokens["big"] > 3 * tokens["small"], tokens


def test_seconds_per_token_follows_the_steps_recorded_with_tokens():
    s = Scheduler()
    s.pick([view("a", 10)])
    s.record("a", 2.0, tokens=1000)
    assert s.seconds_per_token == 0.002
    s.record("a", 0.0)  # an empty draw: charged nothing, the rate unchanged
    assert s.seconds_per_token == 0.002

"""`clora bench fairness`'s training side: the offered load, the tally of a phase shared by the
simulated and the real learner, and the scheduler on the step-cost model (deterministic: a seeded
load on a simulated clock), plus one short phase of the real learner so that the benchmark's real
path cannot break unnoticed."""

from __future__ import annotations

import pytest
from rich.console import Console

from clora.infra.fairness_bench import Arrivals, FairnessBenchConfig, Tally, jain, run_learner, run_real_learner
from clora.learner.scheduler import TenantView


def view(tenant: str, waiting: int) -> TenantView:
    return TenantView(tenant, False, 1.0, 0, 4, waiting)


def test_arrivals_owe_each_tenant_its_rate_beyond_its_start_once():
    a = Arrivals(capacity=10.0, skew=4, start=8)      # light 7.5/s, heavy 30/s
    assert a.due("light", 0.0) == 0 and a.due("heavy", 0.0) == 0
    assert a.due("light", 2.0) == 15 and a.due("heavy", 2.0) == 60
    assert a.due("light", 2.0) == 0, "what was owed is not owed again"
    assert a.due("light", 2.5) == 3                     # int(7.5 * 2.5) = 18, 15 already offered
    assert a.arrived == {"light": 8 + 18, "heavy": 8 + 60}


def test_a_wait_runs_from_becoming_eligible_to_being_picked_and_restarts_when_it_lapses():
    t = Tally()
    t.picking([view("heavy", 4), view("light", 1)], now=1.0)     # light is not eligible yet (4 needed)
    t.picking([view("heavy", 9), view("light", 4)], now=2.0)
    t.picked("heavy", 3.0)
    assert t.waits == {"heavy": [2.0], "light": []}
    t.picking([view("heavy", 0), view("light", 0)], now=4.0)     # light lost its examples: no wait runs
    t.picking([view("heavy", 0), view("light", 5)], now=6.0)
    t.picked("light", 6.5)
    t.picked(None, 7.0)                                         # nothing picked: nothing counted
    assert t.waits == {"heavy": [2.0], "light": [0.5]}


def test_the_tally_counts_tokens_inside_the_windows_after_the_warm_up():
    t = Tally()
    for at in range(60):                                        # both trained each second, heavy 3x
        t.trained("heavy", at + 0.5, 30)
        t.trained("light", at + 0.5, 10)
    phase = t.phase("x", {"heavy": 9999, "light": 999}, seconds=60)   # windows of 20 s after 10 s
    assert phase.served_tokens == {"heavy": 30 * 50, "light": 10 * 50}
    assert phase.jain_whole == pytest.approx(jain([3.0, 1.0]))
    assert len(phase.jain_windows) == 31 and phase.jain_min == pytest.approx(jain([3.0, 1.0]))


def test_on_the_step_cost_model_fair_scheduling_equalises_training_tokens_under_a_10_to_1_skew():
    config = FairnessBenchConfig(learner_minutes=5)
    baseline, fair = run_learner(config, fair=False), run_learner(config, fair=True)
    for phase in (baseline, fair):                    # both want more than the learner can train
        assert all(phase.offered_tokens[t] > phase.served_tokens[t] for t in ("heavy", "light"))
    heavy, light = baseline.served_tokens["heavy"], baseline.served_tokens["light"]
    assert heavy > 1.2 * light, "the old scheduler (uncapped backlog bonus) favours the heavy tenant"
    assert fair.jain_min >= 0.99 > baseline.jain_min
    assert abs(fair.served_tokens["heavy"] - fair.served_tokens["light"]) < 0.02 * fair.served_tokens["light"]
    step_s = config.step_fixed_s + config.step_per_token_s * config.batch_size * 224    # the longest step
    assert max(fair.max_wait_s.values()) <= 2 * step_s, "each tenant waits at most the other's step"


@pytest.mark.slow
def test_the_real_learner_trains_both_tenants_in_each_phase_and_counts_what_it_trained():
    config = FairnessBenchConfig(learner_seconds=12, batch_size=4, learner_min_steps=2)   # however slow the steps
    phases = run_real_learner(config, Console(quiet=True))
    assert [p.mode for p in phases] == ["baseline (real learner)", "fair (real learner)"]
    for p in phases:
        assert all(0 < p.served_tokens[t] < p.offered_tokens[t] for t in ("heavy", "light")), p
        assert all(p.max_wait_s[t] > 0 for t in ("heavy", "light")), p
        assert p.jain_windows, p


def test_the_report_compares_each_fair_serving_phase_with_the_baseline_of_the_same_run(monkeypatch, tmp_path):
    import json

    from clora.infra import fairness_bench

    def phase(mode: str, tokens_per_s: float) -> fairness_bench.Phase:
        return fairness_bench.Phase(mode, {"heavy": 10, "light": 1}, {"heavy": 5, "light": 1}, {"heavy": 1.0, "light": 0.5},
                                    [0.9], 0.9, tokens_per_s)

    served = [phase("baseline", 100.0), phase("fair", 94.0), phase("fair + shares", 82.0)]
    monkeypatch.setattr(fairness_bench, "run_serving", lambda config, console: served)
    out = tmp_path / "fairness.json"
    config = FairnessBenchConfig(learner_seconds=0, learner_minutes=1, shares_phase=True, out=str(out))
    fairness_bench.main(config, Console(quiet=True))
    result = json.loads(out.read_text())
    assert [p["mode"] for p in result["serving"]] == ["baseline", "fair", "fair + shares"]
    assert result["serving_throughput_ratio"] == pytest.approx(0.94)
    assert result["serving_throughput_ratios"] == pytest.approx({"fair": 0.94, "fair + shares": 0.82})

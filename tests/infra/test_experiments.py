"""The pure parts of `clora bench experiments`: statistics, mode A by prefix, the report's shape,
the machine's bound from measured core-seconds, reward curves and the time to a reward threshold,
presets."""

import dataclasses
import json
import math
import os

import pytest
from rich.console import Console

from clora.infra.bench_platform import CoreSeconds
from clora.infra.experiments import (CORE_SPLIT, PRESETS, Bench, BenchConfig, Experiment, ExperimentError,
                                      ExperimentResult, LearnerCounters, Stack, StepRecord, build_report, compare, curve_table,
                                      machine_bound, mean_std, reward_curve, sequential_prefix, summarize, table,
                                      rolling, time_to_reward, training_examples)
from clora.agents.envs import ArithmeticEnv
from clora.agents.runtime import EpisodeTrace, Turn
from clora.agents.simulate import HeldOutScores, OperatorSimulator, Rollout, StepReport
from clora.ids import served_name
from clora.ingest.buffers import is_heldout
from clora.registry import ADAPTER_FILES


def step(i: int, reward: float, rollout: float = 2.0, train: float = 3.0, sync: float = 1.0,
         outcome: str = "published") -> StepRecord:
    return StepRecord(step=i, sampled_version=i - 1 or None, reward=reward, rollouts=8, train_examples=7,
                      rollout_s=rollout, train_s=train, sync_s=sync, outcome=outcome, new_version=i, learner_s=0.5)


def experiment(index: int, started: float, ended: float, rewards: list[float], **kw) -> ExperimentResult:
    return ExperimentResult(f"e{index}", index, started, ended,
                            tuple(step(i + 1, r, **kw) for i, r in enumerate(rewards)), startup_s=1.0)


def test_mean_std_uses_the_sample_deviation():
    assert mean_std([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, 0.5773502))
    assert mean_std([0.25]) == (0.25, 0.0)
    assert all(math.isnan(x) for x in mean_std([]))


def test_mode_a_at_n_is_the_prefix_of_the_sequential_run():
    # one after another: [0, 100], [105, 190], [195, 300]
    seq = [experiment(2, 195, 300, [0.0]), experiment(0, 0, 100, [1.0]), experiment(1, 105, 190, [0.0])]
    assert [e.index for e in sequential_prefix(seq, 2)] == [0, 1]
    assert summarize(sequential_prefix(seq, 1))["wall_s"] == 100
    assert summarize(sequential_prefix(seq, 2))["wall_s"] == 190      # includes the gap (teardown) between them
    assert summarize(sequential_prefix(seq, 3))["wall_s"] == 300
    with pytest.raises(ValueError, match="cannot derive N = 4"):
        sequential_prefix(seq, 4)


def test_summary_means_over_every_step_and_final_rewards():
    exps = [experiment(0, 0, 40, [0.0, 0.5], rollout=2, train=3, sync=1),
            experiment(1, 0, 50, [0.25, 1.0], rollout=4, train=5, sync=3)]
    s = summarize(exps)
    assert s["wall_s"] == 50 and s["mean_experiment_s"] == 45
    assert (s["mean_rollout_s"], s["mean_train_s"], s["mean_sync_s"], s["mean_step_s"]) == (3, 4, 2, 9)
    assert s["final_rewards"] == [0.5, 1.0] and s["reward_mean"] == 0.75
    assert s["reward_std"] == pytest.approx(math.sqrt(0.125))
    assert s["outcomes"] == {"published": 4} and s["mean_learner_step_s"] == 0.5
    assert reward_curve(exps) == [0.125, 0.75]


def test_speedup_growth_and_the_one_sigma_rule():
    a = {"wall_s": 800.0, "mean_step_s": 10.0, "reward_mean": 0.5, "reward_std": 0.1}
    b = {"wall_s": 200.0, "mean_step_s": 18.0, "reward_mean": 0.41, "reward_std": 0.3}
    r = compare(a, b)
    assert r["speedup"] == 4.0 and r["step_growth"] == pytest.approx(1.8)
    assert r["reward_within_1sigma"] and r["reward_delta"] == pytest.approx(-0.09)
    assert not compare(a, {**b, "reward_mean": 0.39})["reward_within_1sigma"]
    # identical all-zero rewards (std 0) are within; any difference then is not
    zero = {**a, "reward_mean": 0.0, "reward_std": 0.0}
    assert compare(zero, {**b, "reward_mean": 0.0})["reward_within_1sigma"]
    assert not compare(zero, {**b, "reward_mean": 0.05})["reward_within_1sigma"]


def test_report_shape_and_target():
    config = BenchConfig(ns=(1, 2, 8), steps=2)
    seq = [experiment(i, 100 * i, 100 * i + 90, [0.0, 0.5]) for i in range(8)]
    conc = {n: [experiment(i, 0, 150 + i, [0.0, 0.5], rollout=3) for i in range(n)] for n in (1, 2, 8)}
    report = json.loads(json.dumps(build_report(config, seq, conc, concurrent_startup_s=42.0)))

    assert [r["n"] for r in report["rows"]] == [1, 2, 8]
    top = report["rows"][-1]
    assert top["sequential"]["wall_s"] == 790 and top["concurrent"]["wall_s"] == 157
    assert top["speedup"] == pytest.approx(790 / 157) and top["step_growth"] == pytest.approx(7 / 6)
    assert report["reference"]["speedup"] == 2.81
    assert top["bound"] is None and report["target"]["met"] is None    # no core-seconds measured: no verdict
    assert report["rows"][0]["speedup"] == pytest.approx(90 / 150)
    assert report["curves"] == {"sequential": [0.0, 0.5], "concurrent": {"1": [0.0, 0.5], "2": [0.0, 0.5],
                                                                          "8": [0.0, 0.5]}}
    assert len(report["experiments"]["sequential"]) == 8 and len(report["experiments"]["concurrent"]["8"]) == 8
    first = report["experiments"]["sequential"][0]
    assert first["seconds"] == 90 and first["final_reward"] == 0.5 and first["steps"][0]["seconds"] == 6
    assert report["config"]["ns"] == [1, 2, 8] and "prefix" in report["note"]
    assert table(report).row_count == 3


def test_report_puts_base_and_final_held_out_scores_side_by_side():
    config = BenchConfig(ns=(1, 2), steps=1, eval_size=5)
    seq = [dataclasses.replace(experiment(i, 10 * i, 10 * i + 9, [0.5]), held_out=HeldOutScores(1.0, 0.2 * i))
           for i in range(2)]
    conc = {1: [dataclasses.replace(experiment(0, 0, 9, [0.5]), held_out=HeldOutScores(0.8, 0.4))],
            2: [dataclasses.replace(experiment(i, 0, 9, [0.5]), held_out=HeldOutScores(0.6, 0.0)) for i in range(2)]}
    report = json.loads(json.dumps(build_report(config, seq, conc, 0.0, base_held_out=HeldOutScores(0.1, 0.05))))

    assert report["base_held_out"] == {"same": 0.1, "unseen": 0.05}
    one, two = report["rows"]
    assert (one["sequential"]["held_out_same_mean"], one["sequential"]["held_out_unseen_mean"]) == (1.0, 0.0)
    assert (two["sequential"]["held_out_same_mean"], two["sequential"]["held_out_unseen_mean"]) == (1.0, 0.1)
    assert (one["concurrent"]["held_out_same_mean"], one["concurrent"]["held_out_unseen_mean"]) == (0.8, 0.4)
    assert report["experiments"]["sequential"][1]["final_held_out"] == {"same": 1.0, "unseen": 0.2}
    console = Console(record=True, width=300)
    console.print(table(report))
    text = console.export_text()
    assert "base model: 0.10 / 0.05" in text and "(5 each)" in text
    assert "A held-out same/unseen" in text and "B held-out same/unseen" in text
    assert "1.00 / 0.10" in text and "0.60 / 0.00" in text


def test_a_report_without_held_out_scores_says_so():
    seq = [experiment(0, 0, 9, [0.0])]
    report = build_report(BenchConfig(ns=(1,), eval_size=0), seq, {1: seq}, 0.0)
    assert report["base_held_out"] is None and report["rows"][0]["sequential"]["held_out_same_mean"] is None
    assert report["experiments"]["sequential"][0]["final_held_out"] is None
    console = Console(record=True, width=300)
    console.print(table(report))
    assert "base model: not evaluated" in console.export_text()


def test_the_held_out_evaluation_scores_the_final_version_or_the_base_on_both_sets(fake_openai):
    config = BenchConfig(eval_size=3)
    exp = Experiment(Stack(fake_openai.url, "http://wh", "http://console", "http://metrics", "token"), "fork", 0,
                     config)
    exp.key, exp.live = "key-1", 4
    assert exp.held_out() == HeldOutScores(0.0, 0.0)      # "I don't know." is never a final answer
    assert {r["model"] for r in fake_openai.requests} == {served_name("fork", 4)}
    env = ArithmeticEnv(difficulties=("easy",))           # held out at the traffic's difficulty
    assert sorted(r["messages"][1]["content"] for r in fake_openai.requests) == \
        sorted(p.key for p in env.held_out()[:3] + env.held_out("unseen")[:3])
    fake_openai.requests.clear()
    exp.held_out(base=True)
    exp.live = None
    exp.held_out()
    assert {r["model"] for r in fake_openai.requests} == {"base"} and len(fake_openai.requests) == 2 * 6


def test_report_without_n8_has_no_verdict():
    seq = [experiment(i, 10 * i, 10 * i + 9, [0.0]) for i in range(2)]
    report = build_report(BenchConfig(ns=(1, 2)), seq, {1: seq[:1], 2: seq}, 0.0)
    assert "met" not in report["target"]


def test_training_examples_count_the_kind_minus_held_out():
    env = ArithmeticEnv()
    p = env.problem(3, "easy")

    def report(reward) -> StepReport:   # 40 one-turn episodes in 10 groups answering in plain text
        rollouts = []
        for k in range(40):
            msgs = (*p.messages, {"role": "assistant", "content": "12"})
            rollouts.append(Rollout(p, EpisodeTrace(msgs, (Turn(f"int-{k}", len(p.messages), (), "stop", 10, 2),),
                                                    "12", "reply", f"grp{k // 4}"), reward(k)))
        operator = OperatorSimulator(env, share=1.0)
        ids = tuple(fb.event_id for r in rollouts for fb in operator.review(r))
        return StepReport("acme", 0, tuple(rollouts), 40, len(ids), (), 1.0, ids)

    held_rl = 4 * sum(is_heldout(f"grp{g}", 0.1) for g in range(10))     # RL: whole groups
    held_sft = sum(is_heldout(f"op-int-{k}:sft", 0.1) for k in range(40))
    assert held_rl > 0 and held_sft > 0               # the fixture exercises both hold-outs
    assert training_examples(report(lambda k: float(k % 2)), "rl") == 40 - held_rl
    # no reward spread: the examples still land (the learner consumes them without a step)
    assert training_examples(report(lambda k: 0.0), "rl") == 40 - held_rl
    assert training_examples(report(lambda k: 0.0), "sft") == 40 - held_sft      # wrong answers, all corrected
    right = report(lambda k: 1.0)
    assert right.correction_ids == () and training_examples(right, "sft") == 0


def test_config_rejects_empty_counts():
    with pytest.raises(ValueError, match="--n"):
        BenchConfig(ns=())
    with pytest.raises(ValueError, match="eval_size must be >= 0"):
        BenchConfig(eval_size=-1)
    with pytest.raises(ValueError, match="--steps"):
        BenchConfig(steps=0)


def test_init_adapter_is_checked_when_configured_and_made_absolute(tmp_path, monkeypatch):
    assert BenchConfig().init_adapter is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lora").mkdir()
    with pytest.raises(ValueError, match="init_adapter: .* missing adapter_config.json, adapter_model.safetensors"):
        BenchConfig(init_adapter="lora")
    for f in ADAPTER_FILES:
        (tmp_path / "lora" / f).write_text("{}")
    assert BenchConfig(init_adapter="lora").init_adapter == str(tmp_path / "lora")


class _Models:
    """The gateway's /v1/models for one tenant: the base until poll `served_from`, then tenant@v1."""

    def __init__(self, tenant: str, served_from: int | None):
        self.tenant, self.served_from, self.polls = tenant, served_from, 0

    def get(self, path: str):
        assert path == "/v1/models"
        self.polls += 1
        v1 = self.served_from is not None and self.polls >= self.served_from
        data = [{"id": self.tenant, "root": served_name(self.tenant, 1) if v1 else "base"}]
        return type("Response", (), {"json": lambda _self: {"data": data}})()


class _Traffic:
    """Records which version the experiment believed live when each rollout started."""

    def __init__(self, exp: Experiment):
        self.exp, self.live_at_rollout = exp, []

    def step(self) -> StepReport:
        self.live_at_rollout.append(self.exp.live)
        return StepReport(self.exp.tenant, len(self.live_at_rollout) - 1, (), 0, 0, (), 1.5)


def _experiment(tmp_path, served_from: int | None) -> tuple[Experiment, _Traffic]:
    for f in ADAPTER_FILES:
        (tmp_path / f).write_text("{}")
    config = BenchConfig(init_adapter=str(tmp_path), poll_s=0.01, step_timeout_s=30)  # a bound a loaded CI never meets
    exp = Experiment(Stack("http://gw", "http://wh", "http://console", "http://metrics", "token"), "fork", 0, config)
    exp.gateway, exp.operator = _Models("fork", served_from), None
    return exp, _Traffic(exp)


def test_first_step_rolls_out_only_once_the_imported_v1_is_served(tmp_path):
    exp, traffic = _experiment(tmp_path, served_from=3)
    first, second = exp._step(traffic), exp._step(traffic)
    assert traffic.live_at_rollout == [1, 1] and exp.gateway.polls == 3   # waited once, before the first rollout
    assert first.sampled_version == 1 and first.import_s > 0 and second.import_s == 0
    assert first.seconds == pytest.approx(first.import_s + 1.5) and first.outcome == "no data"
    exps = [ExperimentResult("fork", 0, 0.0, 10.0, (first, second))]
    assert summarize(exps)["mean_import_s"] == pytest.approx(first.import_s)


def test_an_import_never_served_stops_the_experiment(tmp_path):
    exp, traffic = _experiment(tmp_path, served_from=None)
    exp.c = dataclasses.replace(exp.c, step_timeout_s=0.3)
    with pytest.raises(ExperimentError, match="fork: the imported adapter .* was not served as v1"):
        exp._step(traffic)
    assert traffic.live_at_rollout == []


class _Console:
    """The console's metrics history for one tenant: no learner step ever appears."""

    def get(self, path: str, params=None):
        return type("Response", (), {"json": lambda _self: {"points": []}})()


def test_a_batch_the_learner_skips_for_no_reward_spread_ends_the_train_phase(tmp_path):
    exp, _ = _experiment(tmp_path, served_from=1)
    exp.http, changes, polls = _Console(), [], []
    exp._policy = lambda **kw: changes.append(kw)
    # the learner's flat-batch counter goes up on the third poll; no gate rejection ever
    exp._learner_count = lambda family, **labels: (polls.append(family),
                                                   float(family.endswith("flat_batches") and len(polls) > 4))[1]
    assert exp._train(6) == ("no spread", None, None)
    assert changes == [{"paused": False, "min_new_examples": 6, "batch_size": 6}, {"paused": True}]
    exp._learner_count = lambda family, **labels: 0.0          # nothing happens: the phase times out
    exp.c = dataclasses.replace(exp.c, step_timeout_s=0.3)
    assert exp._train(6)[0] == "train timeout"


class _History:
    """The console's metrics history for one tenant, counting reads: the learner's step and
    its version appear once `stepped` is set."""

    def __init__(self):
        self.reads, self.stepped = 0, False

    def get(self, path: str, params=None):
        self.reads += 1
        points = [{"step": 1, "loss": 0.5, "seconds": 2.0}, {"step": 1, "version": 2}] if self.stepped else []
        return type("Response", (), {"json": lambda _self: {"points": points}})()


def test_the_train_phase_reads_the_console_only_once_the_learner_counted_something_for_the_tenant(tmp_path):
    exp, _ = _experiment(tmp_path, served_from=1)
    exp.http, exp._policy, polls = _History(), lambda **kw: None, []

    def count(family, **labels):   # the learner steps the tenant (and counts it) on the 6th poll
        polls.append(family)
        exp.http.stepped = exp.http.stepped or len(polls) > 3 * 5
        return float(family == "clora_learner_steps" and exp.http.stepped)

    exp._learner_count = count
    assert exp._train(6) == ("published", 2, 2.0)
    assert exp.http.reads == 1        # not one console read while the tenant waited its turn


def test_mode_b_splits_the_cores_between_learner_and_engine_unless_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # platform_env rewrites CLORA_*: keep it in this test
    for k in CORE_SPLIT:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    bench = Bench(BenchConfig(ns=(2,)), root=tmp_path)
    bench.launcher.platform_env("concurrent", concurrent=True)
    assert {k: os.environ[k] for k in CORE_SPLIT} == {"CLORA_LEARNER_NUM_THREADS": "2", "CLORA_ENGINE_RESERVED_CPUS": "2"}
    bench.launcher.platform_env("seq-0")  # mode A: every phase on every core, the platform's defaults
    assert not any(k in os.environ for k in CORE_SPLIT)

    monkeypatch.setenv("CLORA_LEARNER_NUM_THREADS", "3")
    bench = Bench(BenchConfig(ns=(2,)), root=tmp_path)
    for concurrent in (True, False):
        bench.launcher.platform_env("x", concurrent=concurrent)
        assert os.environ["CLORA_LEARNER_NUM_THREADS"] == "3"
    assert "CLORA_ENGINE_RESERVED_CPUS" not in os.environ


def _rendered(t) -> str:
    console = Console(record=True, width=400)
    console.print(t)
    return console.export_text()


def test_the_bound_spreads_b_s_measured_rollout_and_training_work_over_every_core():
    # A: 16 s steps. B: 8 tenants × 2 steps of 53 s; over its 70 s the engine used 96 core-s,
    # the learner 80, the rest 16: per step 6 / 5 / 1, per round of 8 steps 48 / 40 / 8
    seq = [experiment(i, 20 * i, 20 * i + 18, [0.5, 0.5], rollout=10, train=5, sync=1) for i in range(8)]
    conc = [experiment(i, 0, 70, [0.5, 0.5], rollout=36, train=14, sync=3) for i in range(8)]
    a = summarize(seq)
    b = summarize(conc, work=CoreSeconds(engine=96.0, learner=80.0, other=16.0, wall_s=70.0))
    assert b["work"]["engine_core_s_per_step"] == 6.0 and b["work"]["other_core_s_per_step"] == 1.0
    bound = machine_bound(a, b, n=8, cores=2)
    assert (bound["rollout_core_s_per_round"], bound["train_core_s_per_round"], bound["other_core_s_per_round"]) \
        == (48.0, 40.0, 8.0)
    assert bound["bound_step_s"] == 44.0 and bound["bound_growth"] == pytest.approx(44 / 16)
    assert bound["growth_over_bound"] == pytest.approx((53 / 16) / (44 / 16))
    assert bound["busy"] == pytest.approx({"engine": 96 / 140, "learner": 80 / 140})
    # twice the cores halve the least step time: the same measured growth is twice as far off
    assert machine_bound(a, b, n=8, cores=4)["growth_over_bound"] == pytest.approx(2 * 53 / 44)
    assert machine_bound(a, summarize(conc), n=8, cores=2) is None
    assert bound["split_step_s"] is None                # no split given: the cores are shared


def test_a_core_split_bounds_the_round_by_the_busier_side_on_its_own_cores():
    a = summarize([experiment(0, 0, 40, [0.5, 0.5], rollout=10, train=5, sync=1)])
    b = summarize([experiment(i, 0, 70, [0.5, 0.5]) for i in range(8)],
                  work=CoreSeconds(engine=96.0, learner=80.0, other=16.0, wall_s=70.0))   # 48 / 40 per round
    one_each = {"CLORA_LEARNER_NUM_THREADS": "1", "CLORA_ENGINE_RESERVED_CPUS": "1"}
    assert machine_bound(a, b, n=8, cores=2, split=one_each)["split_step_s"] == 48.0     # the engine's core
    engine_three = {"CLORA_LEARNER_NUM_THREADS": "1", "CLORA_ENGINE_RESERVED_CPUS": "1"}
    assert machine_bound(a, b, n=8, cores=4, split=engine_three)["split_step_s"] == 40.0    # now the learner's
    assert machine_bound(a, b, n=8, cores=2, split={"CLORA_LEARNER_NUM_THREADS": "1"})["split_step_s"] is None


def test_mode_a_work_is_the_sum_of_its_experiments_own_platforms():
    seq = [dataclasses.replace(experiment(i, 10 * i, 10 * i + 9, [0.5, 0.5]),
                               work=CoreSeconds(engine=4.0 + i, learner=2.0, other=1.0, wall_s=8.0)) for i in range(3)]
    w = summarize(sequential_prefix(seq, 2))["work"]
    assert (w["engine_core_s"], w["learner_core_s"], w["wall_s"]) == (9.0, 4.0, 16.0)
    assert w["engine_core_s_per_step"] == 9.0 / 4 and w["learner_core_s_per_step"] == 1.0
    unmeasured = [*seq[:1], experiment(1, 10, 19, [0.5])]
    assert summarize(unmeasured)["work"] is None


def test_the_report_s_n8_verdict_is_speedup_and_growth_against_the_bound():
    config = BenchConfig(ns=(8,), steps=2)
    seq = [experiment(i, 100 * i, 100 * i + 90, [0.5, 0.5], rollout=10, train=5, sync=1) for i in range(8)]
    conc = {8: [experiment(i, 0, 150, [0.5, 0.5], rollout=36, train=14, sync=3) for i in range(8)]}  # 5.27x

    def verdict(engine: float) -> tuple[float, bool]:
        work = {8: CoreSeconds(engine=engine, learner=80.0, other=16.0, wall_s=150.0)}
        report = json.loads(json.dumps(build_report(config, seq, conc, 0.0, concurrent_work=work, cores=2)))
        return report["rows"][0]["bound"]["growth_over_bound"], report["target"]["met"]

    off, met = verdict(96.0)                 # bound 44 s a step against 53 s measured: 1.20x the bound
    assert off == pytest.approx(53 / 44) and met is False
    off, met = verdict(120.0)                # bound 50 s: 1.06x, within 10%
    assert off == pytest.approx(53 / 50) and met is True


def test_time_to_reward_counts_start_up_earlier_steps_and_the_reaching_rollout():
    e = experiment(0, 0, 30, [0.5, 0.9, 1.0])            # start-up 1 s, steps of 2 + 3 + 1 s
    assert time_to_reward(e, 0.8) == 1 + 6 + 2
    assert time_to_reward(e, 1.0) == 1 + 12 + 2
    assert time_to_reward(e, 0.5) == 1 + 2
    assert time_to_reward(dataclasses.replace(e, steps=e.steps[:1]), 0.8) is None
    # over 2 steps: the mean of the step and the one before it must reach the threshold
    assert time_to_reward(e, 0.8, window=2) == 1 + 12 + 2      # (0.9 + 1.0) / 2; step 2's (0.5 + 0.9) / 2 is short
    assert time_to_reward(e, 0.5, window=3) == 1 + 12 + 2      # a full window first
    assert time_to_reward(e, 0.97, window=2) is None


def test_rolling_reward_curve_and_window_bounds():
    assert rolling([0.0, 1.0, 0.0, 1.0], 2) == [0.5, 0.5, 0.5]
    assert rolling([0.2, 0.4], 1) == [0.2, 0.4]
    assert rolling([0.2, 0.4], 3) == []
    with pytest.raises(ValueError, match="reward_window must be >= 1"):
        BenchConfig(reward_window=0)
    assert BenchConfig(steps=3, reward_window=4).reward_window == 3
    assert PRESETS["learn"]["reward_window"] == 4 and BenchConfig().reward_window == 1
    # the report's smoothed curve and threshold go by the window; the table shows both curves
    exps = [experiment(0, 0, 30, [0.5, 0.9, 1.0])]
    s = summarize(exps, threshold=0.8, window=2)
    assert s["reward_curve_rolling"] == pytest.approx([0.7, 0.95]) and s["time_to_threshold_s"] == 1 + 12 + 2
    assert summarize(exps, threshold=0.8)["time_to_threshold_s"] == 1 + 6 + 2


def test_a_mode_reaches_the_threshold_when_its_last_experiment_does():
    # A: the second experiment starts at 100 and reaches 0.8 in its first step (1 + 2 s)
    seq = [experiment(0, 0, 90, [0.5, 0.9]), experiment(1, 100, 190, [0.85, 0.4])]
    s = summarize(seq, threshold=0.8)
    assert s["time_to_threshold_s"] == 103 and s["threshold_reached"] == 2
    assert s["reward_curve"] == [0.675, 0.65]
    never = summarize([*seq, experiment(2, 200, 290, [0.5, 0.7])], threshold=0.8)
    assert never["time_to_threshold_s"] is None and never["threshold_reached"] == 2
    conc = [experiment(i, 0, 40, [0.5, 0.9]) for i in range(2)]   # B: together, 1 + 6 + 2 s each
    assert summarize(conc, threshold=0.8)["time_to_threshold_s"] == 9


def test_the_tables_show_the_bound_the_threshold_and_both_modes_curves():
    config = BenchConfig(ns=(1, 2), steps=3, reward_threshold=0.75)
    seq = [experiment(i, 100 * i, 100 * i + 90, [0.25, 0.5, 0.75]) for i in range(2)]
    conc = {1: [experiment(0, 0, 30, [0.5, 0.75, 1.0])],
            2: [experiment(i, 0, 40, [0.0, 0.5, 0.5 + 0.25 * i]) for i in range(2)]}
    work = {n: CoreSeconds(engine=6.0 * n, learner=3.0 * n, other=1.0, wall_s=30.0) for n in conc}
    report = json.loads(json.dumps(build_report(config, seq, conc, 0.0, concurrent_work=work, cores=2)))
    assert report["cores"] == 2 and report["config"]["reward_threshold"] == 0.75
    one, two = report["rows"]
    assert one["sequential"]["reward_curve"] == [0.25, 0.5, 0.75]
    assert one["concurrent"]["reward_curve"] == [0.5, 0.75, 1.0]
    assert two["concurrent"]["reward_curve"] == [0.0, 0.5, 0.625]
    assert (one["concurrent"]["time_to_threshold_s"], two["concurrent"]["threshold_reached"]) == (1 + 6 + 2, 1)
    assert two["sequential"]["time_to_threshold_s"] == 100 + 1 + 12 + 2
    # per step 2 engine + 1 learner core-s: a round of N steps on 2 cores takes at least 1.5 N s
    assert one["bound"]["bound_step_s"] == 1.5 and two["bound"]["bound_step_s"] == 3.0

    text = _rendered(table(report))
    assert "A / B s to reward ≥ 0.75" in text and "15 (1/1) / 9 (1/1)" in text and "115 (2/2) / — (1/2)" in text
    assert "0.50x (4/2/0; 20%/10%)" in text    # N = 2: 3 s against A's 6 s steps; 12 / 60, 6 / 60 of the cores
    curves = _rendered(curve_table(report))
    assert "A, N = 2" in curves and "B, N = 2" in curves and "0.62" in curves
    assert [[c.strip() for c in line.split("│")[2:-1]] for line in curves.splitlines() if "B, N = 1" in line] \
        == [["0.50", "0.75", "1.00"]]
    assert "last" not in curves                 # window 1: no smoothed rows

    smooth = json.loads(json.dumps(build_report(dataclasses.replace(config, reward_window=2), seq, conc, 0.0,
                                                concurrent_work=work, cores=2)))
    assert smooth["rows"][0]["concurrent"]["reward_curve_rolling"] == [0.625, 0.875]
    assert smooth["rows"][0]["concurrent"]["time_to_threshold_s"] == 1 + 12 + 2   # 0.875 over steps 2-3
    rows = [[c.strip() for c in line.split("│")[2:-1]] for line in _rendered(curve_table(smooth)).splitlines()
            if "B, N = 1, last 2" in line]
    assert rows == [["", "0.62", "0.88"]]


def test_presets_set_the_knobs_the_command_line_did_not():
    assert BenchConfig.from_preset("speed") == BenchConfig()
    with pytest.raises(ValueError, match="--preset learn starts from an adapter .*make_calc_adapter"):
        BenchConfig.from_preset("learn")
    with pytest.raises(ValueError, match="--preset must be one of speed, learn"):
        BenchConfig.from_preset("fast")
    with pytest.raises(ValueError, match="reward_threshold must be in"):
        BenchConfig(reward_threshold=0.0)


def test_the_command_line_takes_the_learn_preset_and_overrides_it(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from clora.infra import experiments
    from clora.infra.cli import app

    for f in ADAPTER_FILES:
        (tmp_path / f).write_text("{}")
    seen = []
    monkeypatch.setattr(experiments, "main", seen.append)
    runner = CliRunner()
    ok = runner.invoke(app, ["bench", "experiments", "--preset", "learn", "--init-adapter", str(tmp_path),
                             "--steps", "3", "--reward-threshold", "0.9"])
    assert ok.exit_code == 0, ok.output
    learn = PRESETS["learn"]
    assert (seen[0].steps, seen[0].group_size, seen[0].learning_rate, seen[0].ns) == \
        (3, learn["group_size"], learn["learning_rate"], learn["ns"])
    assert seen[0].preset == "learn" and seen[0].reward_threshold == 0.9
    ok = runner.invoke(app, ["bench", "experiments", "--difficulty", "mixed", "--n", "1,2"])
    assert ok.exit_code == 0, ok.output
    assert seen[1] == BenchConfig(difficulty=None, ns=(1, 2))
    bad = runner.invoke(app, ["bench", "experiments", "--preset", "learn"])
    assert bad.exit_code == 2 and "--init-adapter" in bad.output
    ok = runner.invoke(app, ["bench", "experiments", "--seed", "4"])
    assert ok.exit_code == 0, ok.output
    assert seen[-1] == BenchConfig(seed=4)
    ok = runner.invoke(app, ["bench", "experiments", "--run-id", "b3f0-1"])
    assert ok.exit_code == 0, ok.output
    assert seen[-1] == BenchConfig(run_id="b3f0-1")
    bad = runner.invoke(app, ["bench", "experiments", "--run-id", "a b"])
    assert bad.exit_code == 2 and "--run-id" in bad.output


def test_experiment_i_s_seed_is_i_in_both_modes_and_the_workload_seed_moves_it():
    from clora.infra.experiments import SEED_STRIDE

    stack = Stack("http://gw", "http://wh", "http://console", "http://metrics", "token")
    a, b = (Experiment(stack, t, 3, BenchConfig(), run_id="run-1") for t in ("seq-3", "conc8-3"))
    assert (a.seed, a.run_id) == (b.seed, b.run_id) == (3, "run-1")
    assert Experiment(stack, "seq-3", 3, BenchConfig(seed=2)).seed == 3 + 2 * SEED_STRIDE
    assert Experiment(stack, "x", 0, BenchConfig()).run_id != Experiment(stack, "y", 0, BenchConfig()).run_id


def test_a_bench_records_its_drawn_run_id_and_keeps_a_given_one(tmp_path):
    drawn = [Bench(BenchConfig(), root=tmp_path / str(i)) for i in range(2)]
    assert drawn[0].run_id and drawn[0].run_id != drawn[1].run_id
    assert all(b.config.run_id == b.run_id for b in drawn)      # the config, and so the JSON, records it
    assert Bench(BenchConfig(run_id="run-7"), root=tmp_path / "given").run_id == "run-7"


METRICS = """# TYPE clora_learner_publishes counter
clora_learner_publishes_total{tenant="a",outcome="rejected"} 2.0
clora_learner_publishes_total{tenant="a",outcome="published"} 5.0
clora_learner_publishes_total{tenant="b",outcome="rejected"} 1.0
# TYPE clora_learner_flat_batches counter
clora_learner_flat_batches_total{tenant="a"} 3.0
"""


def test_tenants_polling_the_learner_s_counters_share_one_scrape_until_it_is_stale():
    texts = [METRICS, METRICS.replace('tenant="b",outcome="rejected"} 1.0', 'tenant="b",outcome="rejected"} 4.0')]
    counters = LearnerCounters(lambda: texts[min(counters.scrapes - 1, 1)], max_age_s=3600)
    assert counters.count("clora_learner_publishes", "a", outcome="rejected") == 2.0
    assert counters.count("clora_learner_publishes", "a") == 7.0                  # every outcome
    assert counters.count("clora_learner_flat_batches", "a") == 3.0
    assert counters.count("clora_learner_publishes", "b", outcome="rejected") == 1.0
    assert counters.count("clora_learner_flat_batches", "b") == 0.0
    assert counters.scrapes == 1                                                   # one scrape served them all
    assert counters.count("clora_learner_publishes", "b", fresh=True, outcome="rejected") == 4.0
    assert counters.scrapes == 2
    always = LearnerCounters(lambda: METRICS, max_age_s=0.0)
    always.count("clora_learner_flat_batches", "a")
    always.count("clora_learner_flat_batches", "a")
    assert always.scrapes == 2


def test_mode_b_s_experiments_read_one_shared_counter_cache():
    stack = Stack("http://gw", "http://wh", "http://console", "http://metrics", "token")
    shared = LearnerCounters(lambda: METRICS, max_age_s=3600)
    one, two = (Experiment(stack, t, i, BenchConfig(), counters=shared) for i, t in enumerate("ab"))
    assert one._learner_count("clora_learner_publishes", outcome="rejected") == 2.0
    assert two._learner_count("clora_learner_publishes", outcome="rejected") == 1.0
    assert shared.scrapes == 1
    alone = Experiment(stack, "c", 2, BenchConfig())
    assert alone.counters is not shared and alone.counters.max_age_s == BenchConfig().poll_s


def test_retail_steps_report_turns_per_episode_and_each_rules_pass_rate():
    from clora.agents.envs import RetailEnv
    from clora.infra.experiments import episode_stats, episodes_table

    config = BenchConfig(env="retail", ns=(1,), steps=1, eval_size=0)
    assert (config.max_tokens, config.max_turns) == (64, 10)          # the environment's defaults
    assert (BenchConfig().max_tokens, BenchConfig().max_turns) == (48, 3)
    with pytest.raises(ValueError, match="--env must be one of"):
        BenchConfig(env="chess")
    env = RetailEnv()
    p = env.problem(3, "medium")
    right = EpisodeTrace(tuple(p.messages) + tuple(p.reference), tuple(
        Turn(f"i{k}", k, (), "stop", 1, 1) for k in range(sum(m["role"] == "assistant" for m in p.reference))),
        None, "reply")
    silent = EpisodeTrace(tuple(p.messages) + ({"role": "assistant", "content": "Bye."},),
                          (Turn("j", 2, (), "stop", 1, 1),), None, "reply")
    report = StepReport("t", 0, (Rollout(p, right, 1.0), Rollout(p, silent, 0.0)), 0, 0, (), 1.0)
    stats = episode_stats(env, report)
    assert stats["turns"] == (len(right.turns) + 1) / 2 and stats["rules"]["reward"] == 0.5
    assert stats["rules"]["state"] == 0.5 and stats["rules"]["customer_ended"] == 0.5
    assert episode_stats(ArithmeticEnv(), dataclasses.replace(report, rollouts=()))["rules"] is None

    rec = dataclasses.replace(step(1, 0.5), **stats)
    exp = ExperimentResult("e0", 0, 0, 9, (rec,), startup_s=1.0)
    report = json.loads(json.dumps(build_report(config, [exp], {1: [exp]}, 0.0)))
    assert report["rows"][0]["concurrent"]["rules"]["state"] == 0.5
    assert report["rows"][0]["sequential"]["mean_turns"] == stats["turns"]
    console = Console(record=True, width=300)
    console.print(episodes_table(report))
    text = console.export_text()
    assert "turns per episode" in text and "customer_ended" in text and "A, N = 1" in text

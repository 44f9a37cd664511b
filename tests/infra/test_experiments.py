"""The pure parts of `clora bench experiments`: statistics, mode A by prefix, the report's shape."""

import dataclasses
import json
import math
import os

import pytest
from rich.console import Console

from clora.infra.experiments import (CORE_SPLIT, Bench, BenchConfig, Experiment, ExperimentError, ExperimentResult, Stack, StepRecord,
                                      build_report, compare, mean_std, reward_curve, sequential_prefix, summarize, table,
                                      training_examples)
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
    assert report["target"]["met"] is True and report["reference"]["speedup"] == 2.81
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

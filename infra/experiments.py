"""`clora bench experiments`: N independent RL experiments, one after another vs all at once.

    clora bench experiments [--preset speed|learn] [--n 1,2,4,8] [--steps 5] [--algorithm rl|sft]
                            [--env arithmetic|retail] [--model smollm2|<HF dir>] [--init-adapter DIR]
                            [--reward-threshold 0.8]
    python benchmarks/bench_experiments.py ...      # the same command

Each experiment trains one fresh tenant for K synchronous (on-policy) steps on a tool-use task:
arithmetic (`--env arithmetic`, the default: a calculator call and a final answer) or retail
(`--env retail`: long customer-service conversations with the store's eight tools and a
simulated customer, `clora.agents.envs.retail`; the table then also reports the mean turns per
episode and each reward rule's pass rate). One step:

1. rollout — `TenantTraffic.step()`: `prompts_per_step` problems × `group_size` episodes
   through the gateway, sampled from the tenant's live version; rewards (and, for
   `--algorithm sft`, operator corrections) go through the webhook;
2. train  — the tenant is un-paused with `min_new_examples` = `batch_size` = the step's
   training examples (its feedback records minus the 10% the buffers hold out, computed
   from the example ids), so the learner takes exactly one step on exactly that data
   (`CLORA_LEARNER_FRESH_FRACTION=1`), evaluates and publishes; the tenant is paused again
   once the version (or the gate's rejection, or for RL the learner's skipping a batch in
   which no group has a reward spread: outcome `no spread`) is seen. `eval_tolerance=1` keeps
   the gate from blocking unless the candidate is twice as bad as live;
3. sync   — until the gateway's `/v1/models` entry for the tenant has root `tenant@v<new>`.

With `--init-adapter DIR` (a PEFT LoRA folder fitting the learner's rank, alpha and modules)
every tenant, in both modes, is created from that adapter: the learner publishes it as v1,
and each experiment's first step waits until `tenant@v1` is served before its first rollout
(that wait is the step's `import_s`, counted in its time). Without it tenants start from a
fresh LoRA init and sample the base model until their first version.

Mode A (sequential, "cold"): each experiment gets a fresh platform (broker, Redis, learner,
vLLM engine, gateway; start-up counted in its time), one tenant, then the platform stops —
as a single-tenant RL framework runs. Only N_max experiments run; mode A at a smaller N is
the time to the end of the first N of them (the prefix). Mode B (concurrent, "warm"): one
platform, started once (start-up and one warm-up step reported apart, not counted); for each
N, N fresh tenants run at once, one thread each; while they wait for the learner they share one
scrape of its counters per poll (`LearnerCounters`: the scrapes are served on the learner's
core). Experiment i uses the same problems in both modes (traffic seed i; `--seed S` moves
every experiment's seed by S x `SEED_STRIDE`), samples them with the same seed (`Agent.seed`:
each call's seed follows from it and the conversation so far), and names
its groups alike (`TenantTraffic.group_seed`, from the run's id and i; the buffers hold out
whole groups by id), so both modes' runs of it see the same episodes and train on the same
ones for as long as their versions answer alike. Only the groups with a reward spread train,
so unpaired runs differed by how many steps each mode happened to train, and the speedup with
it.

Reported per N: speedup = A time / B time to the last experiment's end, mean experiment
time, mean step time with its rollout / train / sync means, step-time growth (B / A), each
experiment's final reward (mean reward of its last step's rollouts) and whether B's mean is
within ±1σ of A's, and held-out scores side by side: greedy reward on `eval_size` problems
phrased as the traffic is (`same`) and on as many of the same tasks phrased as it never is
(`unseen`), for the base model (once, on mode B's warm platform) and for every experiment's
final version (right after its last step, outside every timed phase). Prints a table, writes
JSON (`--out`) and a reward-vs-step plot (.png).

The machine's bound. While mode B runs N tenants, `CpuMeter` reads the core-seconds the vLLM
engine (rollouts) and the learner (training) used; everything else (gateway, ingest, broker,
the benchmark's clients) is reported beside it as `other`. The K rounds of N steps cannot take
less than that work spread over every core, so B's step time is at least

    bound_step_s = (engine_core_s + learner_core_s) / (cores × K)

and the step-time growth at least `bound_growth` = bound_step_s / A's mean step. The row
reports both and `growth_over_bound` = measured growth / bound_growth (1.0: every core busy
with rollouts or training the whole time), with the engine's and learner's share of the cores
(`busy`). Mode A's work per step is measured the same way (platform start-up excluded), which
shows what batching N tenants saves.

Learning. Each mode's reward curve (mean rollout reward at each step) is in the JSON, the
table and the plot, beside its mean over the last `--reward-window` steps; `time_to_threshold_s`
is the wall time until every experiment of a mode has had that many steps in a row whose
rollouts averaged at least `--reward-threshold` (0.8), beside the time to finish. `--preset learn` (steps, width and learning rate for a visible rise; needs
`--init-adapter`, as `benchmarks/make_calc_adapter.py --steps 6` makes) is for that;
`--preset speed` (the default) for speed at N = 8.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import httpx
from rich.console import Console
from rich.table import Table

from clora.agents.envs import ArithmeticEnv, RetailEnv
from clora.agents.envs.base import DIFFICULTIES, Difficulty, TaskEnv
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent
from clora.agents.simulate import HeldOutScores, OperatorSimulator, StepReport, TenantTraffic, evaluate_held_out
from clora.ids import served_name
from clora.infra.bench_platform import CORE_SPLIT, CoreSeconds, CpuMeter, PlatformLauncher, Stack, \
    cores_available, core_split
from clora.registry import check_init_adapter

__all__ = ["CORE_SPLIT", "PRESETS", "Bench", "BenchConfig", "Experiment", "ExperimentError", "Stack", "core_split",
           "main"]

REFERENCE = {"name": "SkyRL", "n": 8, "speedup": 2.81, "step_s": [191.0, 500.0], "step_growth": 2.62}
TARGET = {"n": 8, "speedup_at_least": 5.0, "growth_over_bound_at_most": 1.10}
PRESETS: dict[str, dict] = {
    "speed": {},
    # a visible rise from the 6-step SFT adapter (rollout reward ~0.4): 16 on-policy steps of
    # 2 prompts × 8 episodes (wide groups: more of them have a reward spread) at 3e-4, between
    # the bench's cautious 1e-4 for imported adapters and the 2e-3 the SFT itself steps at
    # and the reward read over 4 steps (64 episodes of 8 prompts), not one step's 2 prompts
    "learn": {"ns": (1, 4), "steps": 16, "prompts_per_step": 2, "group_size": 8, "learning_rate": 3e-4,
              "difficulty": "easy", "reward_window": 4},
}
ENV_DEFAULTS: dict[str, dict[str, int]] = {
    "arithmetic": {"max_tokens": 48, "max_turns": 3},
    # a tool call with its JSON arguments fits 64 tokens; 10 turns of them, the customer's
    # answers, the system prompt and the eight tool schemas stay inside SmolLM2's 2048
    "retail": {"max_tokens": 64, "max_turns": 10},
}
"""Per environment: max_tokens per model call and model calls per episode, unless given."""
Outcome = Literal["published", "rejected", "no data", "no spread", "train timeout", "sync timeout"]


RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a run id may be (it becomes part of every group's id)."""

SEED_STRIDE = 100_003
"""`BenchConfig.seed` moves every experiment's seed by this much (more than any N)."""


class ExperimentError(RuntimeError):
    """An experiment could not run (platform, control API or gateway failure)."""


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of one benchmark run (also written to the JSON)."""

    ns: tuple[int, ...] = (1, 2, 4, 8)
    steps: int = 5
    group_size: int = 4
    prompts_per_step: int = 2
    env: Literal["arithmetic", "retail"] = "arithmetic"
    max_tokens: int | None = None
    """None: the environment's (`ENV_DEFAULTS`)."""
    max_turns: int | None = None
    """None: the environment's (`ENV_DEFAULTS`)."""
    temperature: float = 1.0
    algorithm: Literal["rl", "sft"] = "rl"
    difficulty: Difficulty | None = "easy"
    learning_rate: float = 1e-3
    model: str = "smollm2"
    """`smollm2` (converted once into `models_dir`) or a local HF model directory."""
    models_dir: str = ".clora/models"
    training_mode: Literal["serial", "fused"] = "serial"
    step_timeout_s: float = 900.0
    """Longest one train (or sync) phase may wait before the step is reported as timed out."""
    poll_s: float = 0.25
    out: str = "bench-results/experiments.json"
    keep: bool = False
    """Keep the platforms' data folders (logs, adapters) instead of deleting them."""
    init_adapter: str | None = None
    """A PEFT LoRA adapter folder every experiment's tenant starts from (made absolute here);
    None: a fresh LoRA init."""
    eval_size: int = 10
    """Problems of each held-out set (same-template and unseen) the base model and every
    experiment's final version are scored on, untimed; 0: no held-out evaluation."""
    reward_threshold: float = 0.8
    """The mean rollout reward whose first reach each experiment's time is reported at."""
    reward_window: int = 1
    """Steps the threshold's reach and the smoothed curve average over (each step's own mean
    rests on its few prompts: 2 in the learn preset, whose draw moves it more than learning)."""
    seed: int = 0
    """Experiment i's problems, sampling and operator come from seed i + `SEED_STRIDE` x this,
    in both modes: another seed, another workload (0: seed i)."""
    run_id: str | None = None
    """Every experiment's groups are named from it (`Experiment.run_id`), which decides the groups
    the buffers hold out. None: a fresh one per run (`Bench` draws it and the JSON records it);
    a run's recorded one repeats its workload exactly."""
    preset: Literal["speed", "learn"] = "speed"
    """Which `PRESETS` entry the knobs started from (`from_preset`)."""

    def __post_init__(self) -> None:
        if self.env not in ENV_DEFAULTS:
            raise ValueError(f"--env must be one of {', '.join(ENV_DEFAULTS)}, got {self.env!r}")
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", ENV_DEFAULTS[self.env]["max_tokens"])
        if self.max_turns is None:
            object.__setattr__(self, "max_turns", ENV_DEFAULTS[self.env]["max_turns"])
        if not self.ns or min(self.ns) < 1 or self.steps < 1:
            raise ValueError(f"--n must list counts >= 1 and --steps must be >= 1 (got {self.ns}, {self.steps})")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {self.eval_size}")
        if not 0.0 < self.reward_threshold <= 1.0:
            raise ValueError(f"reward_threshold must be in (0, 1], got {self.reward_threshold}")
        if self.run_id is not None and not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"--run-id must be 1-64 letters, digits, '-' or '_', got {self.run_id!r}")
        if self.reward_window < 1:
            raise ValueError(f"reward_window must be >= 1, got {self.reward_window}")
        if self.reward_window > self.steps:        # a preset's window over fewer steps: all of them
            object.__setattr__(self, "reward_window", self.steps)
        if self.preset == "learn" and self.init_adapter is None:
            raise ValueError("--preset learn starts from an adapter that already calls the tools (the base model "
                             "scores 0 and RL gets no gradient): make one with `python benchmarks/make_calc_adapter.py"
                             " --steps 6 --out .clora/calc-sft6-adapter` and pass --init-adapter "
                             ".clora/calc-sft6-adapter")
        if self.init_adapter is not None:  # checked now, not after minutes of platform start-up
            object.__setattr__(self, "init_adapter", check_init_adapter(self.init_adapter))

    @classmethod
    def from_preset(cls, preset: str, **explicit) -> "BenchConfig":
        """The preset's knobs, then those given explicitly (the command line's)."""
        if preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        return cls(**(PRESETS[preset] | explicit | {"preset": preset}))


# --- what one run records ------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One experiment step. Example: rollout 4.1 s on v2 (reward 0.25 over 8 episodes), train
    9.8 s (learner step 3.2 s of it) -> v3 published, sync 0.4 s; `train_examples` 14. With
    `--init-adapter`, step 1 first waited `import_s` (say 2.5 s) for the imported v1 to be served."""

    step: int
    sampled_version: int | None
    """The version the rollouts were sampled from (None: the base model)."""
    reward: float
    rollouts: int
    train_examples: int
    rollout_s: float
    train_s: float
    sync_s: float
    outcome: Outcome
    new_version: int | None = None
    learner_s: float | None = None
    """The learner's own time for the optimizer step (from its metrics history)."""
    errors: int = 0
    import_s: float = 0.0
    """Before the rollout: the wait for the imported v1 to be served (step 1 with --init-adapter)."""
    turns: float = 0.0
    """Mean model calls per episode of the step's rollouts."""
    rules: dict[str, float] | None = None
    """Per reward rule, the share of the step's rollouts that met it (retail's breakdown; None
    for an environment without rules)."""

    @property
    def seconds(self) -> float:
        return self.import_s + self.rollout_s + self.train_s + self.sync_s


@dataclass(frozen=True)
class ExperimentResult:
    """One experiment: `started` / `ended` are seconds since its mode's clock started;
    `startup_s` is the platform start inside it (mode A only)."""

    tenant: str
    index: int
    started: float
    ended: float
    steps: tuple[StepRecord, ...]
    startup_s: float = 0.0
    held_out: HeldOutScores | None = None
    """The final version's held-out scores (None: not evaluated)."""
    work: CoreSeconds | None = None
    """Core-seconds its platform used over its steps (mode A: its own platform; None in B,
    where tenants share one and the round is measured)."""

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def final_reward(self) -> float:
        return self.steps[-1].reward if self.steps else 0.0

    def to_json(self) -> dict:
        return {"tenant": self.tenant, "index": self.index, "started": self.started, "ended": self.ended,
                "seconds": self.seconds, "startup_s": self.startup_s, "final_reward": self.final_reward,
                "final_held_out": asdict(self.held_out) if self.held_out else None,
                "work": asdict(self.work) if self.work else None,
                "steps": [asdict(s) | {"seconds": s.seconds} for s in self.steps]}


# --- pure statistics (unit-tested) -----------------------------------------------------------


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two values). [1, 0, 1, 0] -> (0.5, 0.577)."""
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def sequential_prefix(experiments: Sequence[ExperimentResult], n: int) -> list[ExperimentResult]:
    """The first `n` experiments of the one sequential run of N_max (mode A at N = n)."""
    if n > len(experiments):
        raise ValueError(f"mode A ran {len(experiments)} experiments, cannot derive N = {n}")
    return sorted(experiments, key=lambda e: e.index)[:n]


def time_to_reward(e: ExperimentResult, threshold: float, window: int = 1) -> float | None:
    """Seconds from the experiment's start (its platform's start-up included) to the end of the
    rollouts of its first step whose mean reward, averaged with the `window - 1` steps before
    it, is at least `threshold`; None if none was.
    Example: start-up 30 s, steps of 10 s with rewards 0.5, 0.9 and rollouts of 4 s: 30 + 10 + 4 = 44
    (window 1); with window 2 the mean 0.7 never reaches 0.8: None."""
    elapsed = e.startup_s
    for i, s in enumerate(e.steps):
        if i + 1 >= window and statistics.fmean(x.reward for x in e.steps[i + 1 - window:i + 1]) >= threshold:
            return elapsed + s.import_s + s.rollout_s
        elapsed += s.seconds
    return None


def rolling(curve: Sequence[float], window: int) -> list[float]:
    """The mean of each `window` consecutive values of `curve`, ending at its `window`-th
    value: rolling([0, 1, 0, 1], 2) == [0.5, 0.5, 0.5]."""
    return [statistics.fmean(curve[i + 1 - window:i + 1]) for i in range(window - 1, len(curve))]


def work_summary(work: CoreSeconds | None, steps: int) -> dict | None:
    """Core-seconds by role over `steps` experiment steps, in all and per step."""
    if work is None or not steps:
        return None
    return {"engine_core_s": work.engine, "learner_core_s": work.learner, "other_core_s": work.other,
            "wall_s": work.wall_s, "steps": steps, "engine_core_s_per_step": work.engine / steps,
            "learner_core_s_per_step": work.learner / steps, "other_core_s_per_step": work.other / steps}


def summarize(experiments: Sequence[ExperimentResult], threshold: float = 0.8,
              work: CoreSeconds | None = None, window: int = 1) -> dict:
    """Wall time to the last experiment's end (from the first one's start), mean experiment
    time, mean step time and its phases over every step, final rewards and step outcomes, the
    reward curve (and its `rolling` mean over `window` steps) and the wall time until every
    experiment had reached `threshold` over `window` steps (None unless all did), and the core-seconds used (`work`, or the sum of the experiments' own)."""
    steps = [s for e in experiments for s in e.steps]
    if work is None and experiments and all(e.work is not None for e in experiments):
        work = sum((e.work for e in experiments[1:]), experiments[0].work)
    reached = [(e.started, time_to_reward(e, threshold, window)) for e in experiments]
    curve = reward_curve(experiments)
    finals = [e.final_reward for e in experiments]
    reward_mean, reward_std = mean_std(finals)
    outcomes: dict[str, int] = {}
    for s in steps:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    learner = [s.learner_s for s in steps if s.learner_s is not None]
    held = [e.held_out for e in experiments if e.held_out is not None]
    ruled = [s.rules for s in steps if s.rules]
    return {
        "experiments": len(experiments),
        "wall_s": max(e.ended for e in experiments) - min(e.started for e in experiments),
        "mean_experiment_s": statistics.fmean(e.seconds for e in experiments),
        "mean_startup_s": statistics.fmean(e.startup_s for e in experiments),
        "mean_import_s": statistics.fmean(sum(s.import_s for s in e.steps) for e in experiments),
        "mean_step_s": statistics.fmean(s.seconds for s in steps),
        "mean_rollout_s": statistics.fmean(s.rollout_s for s in steps),
        "mean_train_s": statistics.fmean(s.train_s for s in steps),
        "mean_sync_s": statistics.fmean(s.sync_s for s in steps),
        "mean_learner_step_s": statistics.fmean(learner) if learner else None,
        "mean_turns": statistics.fmean(s.turns for s in steps),
        "rules": {k: statistics.fmean(r[k] for r in ruled) for k in ruled[0]} if ruled else None,
        "final_rewards": finals,
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "held_out_same_mean": statistics.fmean(h.same for h in held) if held else None,
        "held_out_unseen_mean": statistics.fmean(h.unseen for h in held) if held else None,
        "outcomes": outcomes,
        "reward_curve": curve,
        "reward_window": window,
        "reward_curve_rolling": rolling(curve, window),
        "threshold_reached": sum(t is not None for _, t in reached),
        "time_to_threshold_s": (max(start + t for start, t in reached) - min(e.started for e in experiments)
                                if all(t is not None for _, t in reached) else None),
        "work": work_summary(work, len(steps)),
    }


def compare(sequential: dict, concurrent: dict) -> dict:
    """Speedup (A / B time to the last end), step-time growth (B / A) and whether B's mean
    final reward lies within ±1σ (A's sample std) of A's."""
    return {
        "speedup": sequential["wall_s"] / concurrent["wall_s"],
        "step_growth": concurrent["mean_step_s"] / sequential["mean_step_s"],
        "reward_delta": concurrent["reward_mean"] - sequential["reward_mean"],
        "reward_within_1sigma": abs(concurrent["reward_mean"] - sequential["reward_mean"])
        <= sequential["reward_std"] + 1e-9,
    }


def machine_bound(sequential: dict, concurrent: dict, n: int, cores: int,
                  split: dict[str, str] | None = None) -> dict | None:
    """The least step time mode B's measured work allows on `cores`, and the growth it allows.
    B's rounds (one step of each of its `n` tenants) needed `concurrent["work"]` core-seconds of
    rollouts (engine) and training (learner); spread over every core, a round takes at least

        bound_step_s = (engine + learner core-s per step) × n / cores

    Example: 8 tenants, 6.0 engine + 5.0 learner core-s per step on 2 cores -> 44 s; against A's
    16 s steps a growth of 2.75x at least; measured 3.30x is 1.2x the bound. The bound holds for
    B's rounds (`round_s` = its wall time / K); its mean step is compared, which is the round
    while the tenants run in step, as they start together. `busy` is the share of the cores'
    time (over B's wall time) the engine and the learner used. None without a measurement.

    With B's cores split (`split`: the learner's threads, the cores the engine leaves free),
    rollouts and training cannot borrow each other's idle cores, and a round takes at least
    `split_step_s` = max(rollout / engine cores, train / learner cores) (roughly: the engine's
    API server and the learner's helper threads are not pinned). Measured near it and far
    above `bound_step_s`: the split is what is lost; far above both: the tenants' schedule."""
    work = concurrent.get("work")
    if work is None or cores < 1:
        return None
    rollout, train = work["engine_core_s_per_step"] * n, work["learner_core_s_per_step"] * n
    step = (rollout + train) / cores
    growth = step / sequential["mean_step_s"]
    measured = concurrent["mean_step_s"] / sequential["mean_step_s"]
    return {"cores": cores, "rollout_core_s_per_round": rollout, "train_core_s_per_round": train,
            "other_core_s_per_round": work["other_core_s_per_step"] * n, "bound_step_s": step,
            "bound_growth": growth, "growth_over_bound": measured / growth,
            "round_s": concurrent["wall_s"] * n / work["steps"],
            "split_step_s": split_step(rollout, train, cores, split),
            "busy": {"engine": work["engine_core_s"] / (cores * work["wall_s"]),
                     "learner": work["learner_core_s"] / (cores * work["wall_s"])}}


def split_step(rollout: float, train: float, cores: int, split: dict[str, str] | None) -> float | None:
    """The least round time with the engine and the learner on their own cores (None: no split).
    Example: 48 rollout and 40 training core-s per round, 1 core each: 48 s (the whole-machine
    bound on 2 cores is 44 s)."""
    if not split or "CLORA_LEARNER_NUM_THREADS" not in split or "CLORA_ENGINE_RESERVED_CPUS" not in split:
        return None
    learner, engine = int(split["CLORA_LEARNER_NUM_THREADS"]), cores - int(split["CLORA_ENGINE_RESERVED_CPUS"])
    if learner < 1 or engine < 1:
        return None
    return max(rollout / engine, train / learner)


def target_met(row: dict) -> bool | None:
    """Speedup and growth against the bound at the target's N; None when the bound was not measured."""
    if row["bound"] is None:
        return None
    return (row["speedup"] >= TARGET["speedup_at_least"]
            and row["bound"]["growth_over_bound"] <= TARGET["growth_over_bound_at_most"])


def reward_curve(experiments: Sequence[ExperimentResult]) -> list[float]:
    """Mean rollout reward at each step index over the experiments that reached it."""
    longest = max((len(e.steps) for e in experiments), default=0)
    return [statistics.fmean(e.steps[i].reward for e in experiments if len(e.steps) > i) for i in range(longest)]


def build_report(config: BenchConfig, sequential: Sequence[ExperimentResult],
                 concurrent: dict[int, Sequence[ExperimentResult]], concurrent_startup_s: float,
                 base_held_out: HeldOutScores | None = None, concurrent_work: dict[int, CoreSeconds] | None = None,
                 cores: int | None = None, split: dict[str, str] | None = None) -> dict:
    """The JSON the benchmark writes: one row per N comparing the two modes (final held-out
    scores, reward curves, time to the reward threshold and the machine's bound included), the
    base model's held-out scores, every experiment and step, the reference and the target.
    `concurrent_work` is what mode B's run at each N used; `cores` what the platforms shared,
    `split` B's CPU settings (`core_split`)."""
    rows = []
    for n in sorted(concurrent):
        a = summarize(sequential_prefix(sequential, n), config.reward_threshold, window=config.reward_window)
        b = summarize(concurrent[n], config.reward_threshold, (concurrent_work or {}).get(n), config.reward_window)
        rows.append({"n": n, "sequential": a, "concurrent": b, **compare(a, b),
                     "bound": machine_bound(a, b, n, cores, split) if cores else None})
    top = next((r for r in rows if r["n"] == TARGET["n"]), None)
    return {
        "config": asdict(config),
        "note": (f"mode A (sequential, cold start per experiment) ran {len(sequential)} experiments once; "
                 "mode A at N is the time to the end of its first N (the prefix). Mode B (concurrent) ran on one "
                 "warm platform; its start-up and warm-up step are not counted."),
        "concurrent_startup_s": concurrent_startup_s,
        "base_held_out": asdict(base_held_out) if base_held_out else None,
        "cores": cores,
        "core_split": split,
        "rows": rows,
        "target": TARGET | ({"met": target_met(top)} if top else {}),
        "reference": REFERENCE,
        "curves": {"sequential": reward_curve(sequential),
                   "concurrent": {str(n): reward_curve(exps) for n, exps in concurrent.items()}},
        "experiments": {"sequential": [e.to_json() for e in sequential],
                        "concurrent": {str(n): [e.to_json() for e in exps] for n, exps in concurrent.items()}},
        "time": time.time(),
    }


def table(report: dict) -> Table:
    t = Table(title=f"{len(report['experiments']['sequential'])} experiments × {report['config']['steps']} steps "
                    f"({report['config']['algorithm']}, {report['config']['training_mode']} learner): "
                    "A = one after another (cold), B = at once (warm)")
    base = report.get("base_held_out")
    threshold = report["config"]["reward_threshold"]
    t.caption = ("held-out = greedy reward on problems phrased as the traffic is / on the same tasks phrased as it "
                 f"never is ({report['config']['eval_size']} each); base model: "
                 + (f"{base['same']:.2f} / {base['unseen']:.2f}" if base else "not evaluated")
                 + "; bound = the growth B's measured rollout + training core-seconds allow on "
                 f"{report.get('cores') or '?'} cores (split: with B's engine and learner each on its own cores; "
                 "core-s per round: rollout / train / other; busy: engine / learner share of the cores); "
                 f"to reward ≥ {threshold:g} = time until every experiment had "
                 + ("a step" if report["config"].get("reward_window", 1) == 1
                    else f"{report['config']['reward_window']} steps in a row")
                 + " averaging that (experiments that did)")
    for col in ("N", "A time s", "B time s", "speedup", "A exp s", "B exp s", "A step s (roll/train/sync)",
                "B step s (roll/train/sync)", "step growth", "bound growth (core-s/round; busy)", "growth / bound",
                f"A / B s to reward ≥ {threshold:g}", "A final reward", "B final reward", "B within ±1σ",
                "A held-out same/unseen", "B held-out same/unseen"):
        t.add_column(col, justify="right")

    def step(s: dict) -> str:
        return f"{s['mean_step_s']:.1f} ({s['mean_rollout_s']:.1f}/{s['mean_train_s']:.1f}/{s['mean_sync_s']:.1f})"

    def held(s: dict) -> str:
        if s.get("held_out_same_mean") is None:
            return "—"
        return f"{s['held_out_same_mean']:.2f} / {s['held_out_unseen_mean']:.2f}"

    def bound(r: dict) -> tuple[str, str]:
        w = r["bound"]
        if w is None:
            return "—", "—"
        split = "" if w["split_step_s"] is None else \
            f"split {w['split_step_s'] / r['sequential']['mean_step_s']:.2f}x; "
        return (f"{w['bound_growth']:.2f}x ({split}{w['rollout_core_s_per_round']:.0f}/"
                f"{w['train_core_s_per_round']:.0f}/{w['other_core_s_per_round']:.0f}; {w['busy']['engine']:.0%}/{w['busy']['learner']:.0%})",
                f"{w['growth_over_bound']:.2f}")

    def reached(s: dict) -> str:
        t = s["time_to_threshold_s"]
        return (f"{t:.0f}" if t is not None else "—") + f" ({s['threshold_reached']}/{s['experiments']})"

    for r in report["rows"]:
        a, b = r["sequential"], r["concurrent"]
        t.add_row(str(r["n"]), f"{a['wall_s']:.0f}", f"{b['wall_s']:.0f}", f"{r['speedup']:.2f}x",
                  f"{a['mean_experiment_s']:.0f}", f"{b['mean_experiment_s']:.0f}", step(a), step(b),
                  f"{r['step_growth']:.2f}x", *bound(r), f"{reached(a)} / {reached(b)}",
                  f"{a['reward_mean']:.2f} ± {a['reward_std']:.2f}",
                  f"{b['reward_mean']:.2f} ± {b['reward_std']:.2f}", "yes" if r["reward_within_1sigma"] else "NO",
                  held(a), held(b))
    return t


def episodes_table(report: dict) -> Table:
    """Per mode and N: the mean model calls per episode and, for an environment whose reward has
    rules (retail), the share of rollouts that met each."""
    rows = [(f"{label}, N = {r['n']}", r[mode]) for r in report["rows"]
            for mode, label in (("sequential", "A"), ("concurrent", "B"))]
    rules = next((s["rules"] for _, s in rows if s.get("rules")), None) or {}
    t = Table(title="episodes: model calls per episode" + (", and the share of rollouts meeting each reward rule "
                                                           "(reward = state and info)" if rules else ""))
    t.add_column("mode, N")
    t.add_column("turns per episode", justify="right")
    for rule in rules:
        t.add_column(rule, justify="right")
    for label, s in rows:
        t.add_row(label, f"{s['mean_turns']:.1f}", *(f"{(s.get('rules') or {}).get(k, float('nan')):.2f}"
                                                     for k in rules))
    return t


def curve_table(report: dict) -> Table:
    """Mean rollout reward at each step: mode A (the first N experiments) and mode B, per N."""
    rows = report["rows"]
    longest = max((len(r[m]["reward_curve"]) for r in rows for m in ("sequential", "concurrent")), default=0)
    t = Table(title="mean rollout reward per step (A: the first N experiments, one after another; B: N at once)")
    t.add_column("mode, N")
    for i in range(longest):
        t.add_column(str(i + 1), justify="right")
    for r in rows:
        for mode, label in (("sequential", "A"), ("concurrent", "B")):
            curve = r[mode]["reward_curve"]
            t.add_row(f"{label}, N = {r['n']}", *(f"{x:.2f}" for x in curve), *([""] * (longest - len(curve))))
            window = r[mode].get("reward_window", 1)
            if window > 1:        # the same, over the last `window` steps
                smooth = r[mode]["reward_curve_rolling"]
                t.add_row(f"{label}, N = {r['n']}, last {window}", *([""] * (window - 1)), *(f"{x:.2f}" for x in smooth),
                          *([""] * (longest - len(smooth) - window + 1)))
    return t


def plot(report: dict, path: Path) -> Path | None:
    """Mean reward vs step, mode A and mode B at each N. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = report["curves"]
    seq = curves["sequential"]
    ax.plot(range(1, len(seq) + 1), seq, "k-o", label=f"A: sequential, cold (N={len(report['experiments']['sequential'])})")
    for n, ys in curves["concurrent"].items():
        ax.plot(range(1, len(ys) + 1), ys, "--s", label=f"B: concurrent, warm, N={n}")
    ax.axhline(report["config"]["reward_threshold"], color="grey", lw=0.8, ls=":", label="reward threshold")
    ax.set(xlabel="step", ylabel="mean rollout reward", ylim=(-0.05, 1.05),
           title=f"{report['config']['env']} tool use, {report['config']['algorithm']}: reward per step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- one experiment against a running platform -------------------------------------------------


def training_examples(report: StepReport, algorithm: str) -> int:
    """How many of the step's examples land in the tenant's training buffer: one per feedback
    record of the algorithm's kind (RL: every turn's reward; SFT: the corrections the step
    sent), minus those the buffers hold out (a hash of the example id, or for RL of the
    rollout's group id; ids as `clora.ingest.joiner` builds them from the simulator's event
    ids)."""
    from clora.ingest.buffers import BufferPolicy, is_heldout

    fraction = BufferPolicy().holdout_fraction
    if algorithm == "rl":
        return sum(not is_heldout(r.trace.group_id or iid, fraction)
                   for r in report.rollouts for iid in r.trace.interaction_ids)
    return sum(not is_heldout(f"{event_id}:sft", fraction) for event_id in report.correction_ids)


def episode_stats(env: TaskEnv, report: StepReport) -> dict:
    """A step's mean model calls per episode and each reward rule's pass rate over its rollouts."""
    if not report.rollouts:
        return {"turns": 0.0, "rules": None}
    breakdowns = [env.breakdown(r.problem, list(r.trace.messages)) for r in report.rollouts]
    return {"turns": statistics.fmean(len(r.trace.turns) for r in report.rollouts),
            "rules": {k: statistics.fmean(b[k] for b in breakdowns) for k in breakdowns[0]} if breakdowns[0] else None}


EVAL_CONCURRENCY = 8
"""Held-out episodes in flight per scored tenant (within a tenant's share of the engine)."""


def bench_env(config: BenchConfig) -> TaskEnv:
    """The task every experiment trains on, held out at the traffic's difficulty."""
    difficulties = (config.difficulty,) if config.difficulty else DIFFICULTIES
    return RetailEnv(difficulties) if config.env == "retail" else ArithmeticEnv(difficulties=difficulties)


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: dict[str, str]
    value: float


class LearnerCounters:
    """The learner's Prometheus counters, scraped at most once every `max_age_s` for all the
    experiments sharing this object (mode B's tenants): N tenants waiting for training cost the
    learner one scrape per poll, not N. Each scrape is served by the learner process, on the
    core it trains on (a few ms of its CPU each). `fetch` returns the exposition text."""

    def __init__(self, fetch: Callable[[], str], max_age_s: float):
        self.fetch, self.max_age_s = fetch, max_age_s
        self.scrapes = 0
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._samples: list[_Sample] = []

    def count(self, family: str, tenant: str, *, fresh: bool = False, **labels: str) -> float:
        """The counter `family` (its `_total`) summed over the samples of `tenant` with `labels`."""
        with self._lock:       # a poller that waits here reuses the scrape the one ahead of it made
            if fresh or time.monotonic() - self._at > self.max_age_s:
                self._samples = self._scrape()
                self._at = time.monotonic()
            samples = self._samples
        return sum(s.value for s in samples if s.name == f"{family}_total" and s.labels.get("tenant") == tenant
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def _scrape(self) -> list[_Sample]:
        from prometheus_client.parser import text_string_to_metric_families

        self.scrapes += 1
        return [_Sample(s.name, s.labels, s.value) for fam in text_string_to_metric_families(self.fetch())
                for s in fam.samples]


class Experiment:
    """One tenant's K on-policy steps (rollout -> train -> sync) on a running platform, and
    the held-out scores of what it ends with (`held_out`)."""

    def __init__(self, stack: Stack, tenant: str, index: int, config: BenchConfig,
                 on_step: Callable[[str, StepRecord], None] | None = None, counters: LearnerCounters | None = None,
                 run_id: str | None = None):
        self.stack, self.tenant, self.index, self.c, self.on_step = stack, tenant, index, config, on_step
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.seed = index + SEED_STRIDE * config.seed
        """Shared by both modes' runs of this experiment: its group ids follow from it (`TenantTraffic.group_seed`)."""
        self.env = bench_env(config)
        self.counters = counters or LearnerCounters(lambda: httpx.get(stack.learner_metrics, timeout=30).text,
                                                    config.poll_s)
        self.http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {stack.admin_token}"})
        self.live: int | None = None
        self.learner_step = 0

    def run(self) -> list[StepRecord]:
        from openai import OpenAI

        c, env = self.c, self.env
        key = self.key = self._create_tenant()
        client = OpenAI(base_url=self.stack.gateway + "/v1", api_key=key, max_retries=2, timeout=600)
        agent = Agent(client, self.tenant, tools=env.tools, max_turns=c.max_turns, temperature=c.temperature,
                      max_tokens=c.max_tokens, seed=self.seed)
        self.operator = OperatorSimulator(env, share=1.0, seed=self.seed) if c.algorithm == "sft" else None
        traffic = TenantTraffic(self.tenant, agent, env, FeedbackClient(self.stack.webhook, key),
                                group_size=c.group_size, prompts_per_step=c.prompts_per_step,
                                concurrency=c.prompts_per_step, difficulty=c.difficulty, seed=self.seed,
                                operator=self.operator, group_seed=f"grp-{self.run_id}-{self.index}")
        self.gateway = httpx.Client(base_url=self.stack.gateway, timeout=60, headers={"Authorization": f"Bearer {key}"})
        records = []
        try:
            for _ in range(c.steps):
                records.append(self._step(traffic))
                if self.on_step:
                    self.on_step(self.tenant, records[-1])
        finally:
            client.close()
            self.gateway.close()
            self.http.close()
        return records

    def held_out(self, base: bool = False) -> HeldOutScores:
        """Greedy scores on `eval_size` problems of each held-out set, after `run`: of the version
        the experiment ended with (pinned by name, the base model if it never published one), or
        with `base` of the base model."""
        from openai import OpenAI

        env = self.env
        model = "base" if base or self.live is None else served_name(self.tenant, self.live)
        with OpenAI(base_url=self.stack.gateway + "/v1", api_key=self.key, max_retries=2, timeout=600) as client:
            agent = Agent(client, model, tools=env.tools, max_turns=self.c.max_turns, max_tokens=self.c.max_tokens)
            return evaluate_held_out(agent, env, self.c.eval_size, concurrency=EVAL_CONCURRENCY)

    def _create_tenant(self) -> str:
        # the reference's experiments have no reward guard: a rollback would break the one
        # version per step that makes both modes' steps comparable
        policy = {"algorithm": self.c.algorithm, "learning_rate": self.c.learning_rate, "batch_size": 1,
                  "min_new_examples": 1, "eval_tolerance": 1.0, "reward_guard": False, "paused": True}
        body = {"id": self.tenant, "name": "bench experiment", "policy": policy}
        if self.c.init_adapter is not None:
            body["init_adapter"] = self.c.init_adapter
        r = self.http.post(f"{self.stack.console}/api/tenants", json=body)
        if r.status_code != 201:
            raise ExperimentError(f"creating tenant {self.tenant} failed: {r.status_code} {r.text}")
        return r.json()["api_key"]

    def _policy(self, **changes) -> None:
        r = self.http.patch(f"{self.stack.console}/api/tenants/{self.tenant}/policy", json=changes)
        if r.status_code != 200:
            raise ExperimentError(f"policy {changes} of {self.tenant} refused: {r.status_code} {r.text}")

    def _step(self, traffic: TenantTraffic) -> StepRecord:
        import_s = self._wait_import() if self.c.init_adapter is not None and self.live is None else 0.0
        sampled = self.live
        report = traffic.step()
        n = training_examples(report, self.c.algorithm)
        common = dict(step=report.step + 1, sampled_version=sampled, reward=report.mean_reward,
                      rollouts=len(report.rollouts), train_examples=n, rollout_s=report.seconds,
                      errors=len(report.errors), import_s=import_s, **episode_stats(self.env, report))
        if n == 0:
            return StepRecord(**common, train_s=0.0, sync_s=0.0, outcome="no data")
        started = time.monotonic()
        outcome, version, learner_s = self._train(n)
        train_s = time.monotonic() - started
        sync_s = 0.0
        if version is not None:
            started = time.monotonic()
            if self._wait_served(version):
                self.live = version
            else:
                outcome = "sync timeout"
            sync_s = time.monotonic() - started
        return StepRecord(**common, train_s=train_s, sync_s=sync_s, outcome=outcome, new_version=version,
                          learner_s=learner_s)

    def _wait_import(self) -> float:
        """Wait until the imported adapter (the tenant's v1) is served; returns the seconds waited."""
        started = time.monotonic()
        if not self._wait_served(1):
            raise ExperimentError(f"{self.tenant}: the imported adapter {self.c.init_adapter} was not served as v1 "
                                  f"within {self.c.step_timeout_s:.0f} s (the learner log says why, e.g. a rank, "
                                  "alpha or target modules that do not match the learner's)")
        self.live = 1
        return time.monotonic() - started

    def _train(self, n: int) -> tuple[Outcome, int | None, float | None]:
        """Let the learner take one step on the `n` new examples; wait for its version, the
        gate's rejection, or (RL) its skipping a batch in which no group has a reward spread.
        Returns (outcome, new version, the learner's step seconds)."""
        rejected, flat = self._learner_count("clora_learner_publishes", fresh=True, outcome="rejected"), \
            self._learner_count("clora_learner_flat_batches")
        untouched = self._progress()
        self._policy(paused=False, min_new_examples=n, batch_size=n)
        deadline = time.monotonic() + self.c.step_timeout_s
        trained: dict | None = None
        outcome: Outcome = "train timeout"
        version = None
        try:
            while time.monotonic() < deadline:
                if self._progress() == untouched:   # the learner has not reached this tenant yet
                    time.sleep(self.c.poll_s)
                    continue
                points = self.http.get(f"{self.stack.console}/api/tenants/{self.tenant}/metrics",
                                       params={"n": 20}).json()["points"]
                new = [p for p in points if (p.get("step") or 0) > self.learner_step]
                trained = trained or next((p for p in new if p.get("loss") is not None), None)
                version = next((p["version"] for p in new if p.get("version") is not None), None)
                if version is not None:
                    outcome = "published"
                    break
                if trained is not None and self._learner_count("clora_learner_publishes",
                                                               outcome="rejected") > rejected:
                    outcome = "rejected"
                    break
                if trained is None and self._learner_count("clora_learner_flat_batches") > flat:
                    outcome = "no spread"
                    break
                time.sleep(self.c.poll_s)
        finally:
            self._policy(paused=True)
        if trained is not None:
            self.learner_step = trained["step"]
        return outcome, version, trained.get("seconds") if trained else None

    def _progress(self) -> float:
        """Steps, flat batches and gate outcomes the learner has counted for this tenant. Until
        one of them moves, `_train` reads only the shared scrape, not the console: N tenants
        queued for the learner polled the console N times every `poll_s`, and on 2 cores that
        client load (about 5 ms of the console's CPU a read) came out of the work measured."""
        return sum(self._learner_count(f) for f in ("clora_learner_steps", "clora_learner_flat_batches",
                                                    "clora_learner_publishes"))

    def _learner_count(self, family: str, fresh: bool = False, **labels: str) -> float:
        """A learner counter for this tenant (Prometheus), e.g. gate rejections or flat batches;
        `fresh`: scraped now, not up to `poll_s` ago by another experiment."""
        return self.counters.count(family, self.tenant, fresh=fresh, **labels)

    def _wait_served(self, version: int) -> bool:
        want = served_name(self.tenant, version)
        deadline = time.monotonic() + self.c.step_timeout_s
        while time.monotonic() < deadline:
            models = self.gateway.get("/v1/models").json()["data"]
            if next((m.get("root") for m in models if m["id"] == self.tenant), None) == want:
                return True
            time.sleep(self.c.poll_s)
        return False


# --- platforms and the two modes ---------------------------------------------------------------------


@dataclass
class Bench:
    config: BenchConfig
    console: Console = field(default_factory=lambda: Console() if sys.stdout.isatty() else Console(width=200))
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="clora-bench-experiments-")))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.config.run_id is None:          # drawn now, so that the JSON's config records it
            self.config = replace(self.config, run_id=uuid.uuid4().hex[:12])
        # mode B runs max(ns) experiments at once: every one's adapter in one engine batch
        c = self.config
        self.launcher = PlatformLauncher(model=c.model, models_dir=c.models_dir, slots=max(c.ns),
                                         training_mode=c.training_mode, root=self.root)

    @property
    def run_id(self) -> str:
        """Both modes' experiment i name their groups from it and i (`Experiment.run_id`)."""
        return self.config.run_id

    def run(self) -> dict:
        c = self.config
        self.console.print(f"[bold]clora bench experiments[/] ({c.env}): N = {list(c.ns)}, {c.steps} steps each, "
                           f"{c.prompts_per_step} prompts × group {c.group_size}, {c.algorithm}, model {c.model}, "
                           f"{c.training_mode} learner" + (f", tenants from {c.init_adapter}" if c.init_adapter else "")
                           + f"; data under {self.root}")
        with self.launcher.data_kept_on_failure(c.keep, self.console):
            self.launcher.prepare_model()
            sequential = self.sequential(max(c.ns))
            startup, base_held_out, concurrent, work = self.concurrent(sorted(set(c.ns)))
        report = build_report(c, sequential, concurrent, startup, base_held_out, work, cores_available(),
                              self.launcher.split(concurrent=True))
        self.console.print(table(report))
        self.console.print(curve_table(report))
        self.console.print(episodes_table(report))
        self._verdict(report)
        out = Path(c.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        png = plot(report, out.with_suffix(".png"))
        self.console.print(f"wrote {out}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
        return report

    def _verdict(self, report: dict) -> None:
        self.console.print(report["note"])
        self.console.print(f"mode B platform start-up + warm-up step: {report['concurrent_startup_s']:.0f} s (not counted)")
        if report["config"]["init_adapter"]:
            waits = ", ".join(f"N = {r['n']}: A {r['sequential']['mean_import_s']:.1f} s, "
                              f"B {r['concurrent']['mean_import_s']:.1f} s" for r in report["rows"])
            self.console.print(f"tenants started from {report['config']['init_adapter']}; mean wait for the "
                               f"imported v1 to be served (in step 1's time): {waits}")
        for r in report["rows"]:
            if r["n"] == TARGET["n"]:
                w = r["bound"]
                bound = (f"{w['bound_growth']:.2f}x allowed by the {w['bound_step_s']:.1f} s of rollout + training "
                         f"core-seconds per round on {w['cores']} cores: {w['growth_over_bound']:.2f}x the bound"
                         if w else "no bound measured")
                self.console.print(
                    f"N = 8: speedup {r['speedup']:.2f}x (target >= {TARGET['speedup_at_least']}x, "
                    f"{REFERENCE['name']} {REFERENCE['speedup']}x), step time growth {r['step_growth']:.2f}x "
                    f"({REFERENCE['name']} {REFERENCE['step_growth']}x; {bound}, target <= "
                    f"{TARGET['growth_over_bound_at_most']}x): "
                    + ("[green]met[/]" if report["target"].get("met") else "[red]not met[/]"))
        exps = report["experiments"]
        bad: dict[str, int] = {}
        for e in exps["sequential"] + [e for group in exps["concurrent"].values() for e in group]:
            for s in e["steps"]:
                if s["outcome"] != "published":
                    bad[s["outcome"]] = bad.get(s["outcome"], 0) + 1
        if bad:
            self.console.print(f"[yellow]steps without a new version[/]: {bad} (see each step's `outcome` in the JSON)")
        rewards = [s["reward"] for e in exps["sequential"] for s in e["steps"]]
        if report["config"]["algorithm"] == "rl" and not any(rewards):
            self.console.print("[yellow]every sequential rollout scored 0[/]: each group's rewards are equal, so the "
                               "GRPO advantages and the RL loss are 0 and the adapters do not move (try "
                               "--algorithm sft, or an easier task)")

    def _progress(self, mode: str, total: int | None = None) -> Callable[[str, StepRecord], None]:
        total = total or self.config.steps

        def line(tenant: str, s: StepRecord) -> None:
            v = "base" if s.sampled_version is None else f"v{s.sampled_version}"
            new = f" -> v{s.new_version}" if s.new_version is not None else ""
            imported = f"imported v1 served after {s.import_s:.1f} s, " if s.import_s else ""
            with self._lock:
                self.console.print(f"[{mode}] {tenant} step {s.step}/{total}: {imported}rollout {s.rollout_s:.1f} s "
                                   f"(on {v}, reward {s.reward:.2f}, {s.rollouts} episodes), train {s.train_s:.1f} s "
                                   f"({s.train_examples} examples), sync {s.sync_s:.1f} s: {s.outcome}{new}",
                                   highlight=False)
        return line

    def _scored(self, exp: Experiment, result: ExperimentResult) -> ExperimentResult:
        """`result` with the held-out scores of the version `exp` ended with (unless eval_size is 0)."""
        if not self.config.eval_size:
            return result
        held = exp.held_out()
        with self._lock:
            self.console.print(f"{result.tenant}: held-out same {held.same:.2f}, unseen {held.unseen:.2f} "
                               f"({_served(exp.tenant, exp.live)})", highlight=False)
        return replace(result, held_out=held)

    def sequential(self, n: int) -> list[ExperimentResult]:
        """Mode A: n experiments one after another, each on its own fresh platform. Each one's
        held-out evaluation runs before its platform stops, off the clock."""
        results, clock = [], time.monotonic()
        for i in range(n):
            started = time.monotonic() - clock
            platform, stack = self.launcher.start(f"seq-{i}")
            try:
                startup = time.monotonic() - clock - started
                self.console.print(f"[A] experiment {i + 1}/{n}: platform up in {startup:.0f} s")
                meter = CpuMeter(platform)
                before = meter.read()
                exp = Experiment(stack, f"seq-{i}", i, self.config, self._progress("A"), run_id=self.run_id)
                steps = exp.run()
                ended = time.monotonic() - clock
                work = meter.read() - before
                scoring = time.monotonic()
                result = self._scored(exp, ExperimentResult(f"seq-{i}", i, started, ended, tuple(steps), startup,
                                                            work=work))
                clock += time.monotonic() - scoring      # the evaluation is in no experiment's time
            finally:
                platform.stop()
            results.append(result)
        return results

    def concurrent(self, ns: Sequence[int]) -> tuple[float, HeldOutScores | None, dict[int, list[ExperimentResult]],
                                                     dict[int, CoreSeconds]]:
        """Mode B: one warm platform; for each n, n fresh tenants at once, scored on the held-out
        sets once all n have ended. Returns (start-up + warm-up seconds, the base model's held-out
        scores, experiments per n, the core-seconds each n's experiments used)."""
        started = time.monotonic()
        platform, stack = self.launcher.start("concurrent", concurrent=True)
        try:
            warm = Experiment(stack, "warmup", 10_000, replace(self.config, steps=1), self._progress("B warm-up", 1))
            warm.run()
            startup = time.monotonic() - started
            self.console.print(f"[B] platform up and warm in {startup:.0f} s")
            base = warm.held_out(base=True) if self.config.eval_size else None
            if base:
                self.console.print(f"base model: held-out same {base.same:.2f}, unseen {base.unseen:.2f}")
            out, work = {}, {}
            meter = CpuMeter(platform)
            counters = LearnerCounters(lambda: httpx.get(stack.learner_metrics, timeout=30).text, self.config.poll_s)
            for n in ns:
                before = meter.read()
                clock = time.monotonic()

                def one(i: int, n=n, clock=clock) -> tuple[Experiment, ExperimentResult]:
                    tenant = f"conc{n}-{i}"
                    exp = Experiment(stack, tenant, i, self.config, self._progress(f"B N={n}"), counters,
                                     run_id=self.run_id)
                    steps = exp.run()
                    return exp, ExperimentResult(tenant, i, 0.0, time.monotonic() - clock, tuple(steps))

                with ThreadPoolExecutor(max_workers=n) as pool:
                    runs = [f.result() for f in [pool.submit(one, i) for i in range(n)]]
                    work[n] = meter.read() - before
                    self.console.print(f"[B] N = {n}: all done in {max(r.ended for _, r in runs):.0f} s, "
                                       f"engine {work[n].engine:.0f} / learner {work[n].learner:.0f} / other "
                                       f"{work[n].other:.0f} core-s")
                    out[n] = list(pool.map(lambda run: self._scored(*run), runs))
        finally:
            platform.stop()
        return startup, base, out, work


def _served(tenant: str, version: int | None) -> str:
    return "base model" if version is None else served_name(tenant, version)


def main(config: BenchConfig) -> dict:
    return Bench(config).run()

"""Traffic and operator simulators: what drives a tenant's agent against the platform.

`TenantTraffic.step()` draws `prompts_per_step` training problems from the tenant's
environment, runs `group_size` rollouts of each (one group id per prompt, first turn
sampled with `n=group_size`), scores them with the environment's reward and sends one
feedback record per turn (source `environment`, score = the episode's reward, event id
`env-<interaction id>` so a resent step is not counted twice). An `OperatorSimulator`
attached to it corrects a share of the answers with the environment's reference
(source `operator`, event id `op-<interaction id>`). `run_tenants` runs several tenants
concurrently, one thread each; `evaluate` scores an agent on a held-out set, and
`evaluate_held_out` on both (the traffic's phrasings and unseen ones) at once.

Unit tests drive these against a fake OpenAI server and a fake webhook; the demo and the
benchmarks drive them against the real gateway and webhook.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clora.agents.envs.base import Difficulty, Problem, TaskEnv
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent, AgentError, EpisodeTrace
from clora.ingest.schemas import FeedbackIn, Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    problem: Problem
    trace: EpisodeTrace
    reward: float


@dataclass(frozen=True)
class StepReport:
    """One traffic step of one tenant. Example: 2 prompts × group 4 → 8 rollouts; with 2
    turns each, 16 reward records; `errors` lists episodes that failed (with why);
    `correction_ids` are the event ids of the corrections sent (`op-<interaction id>`)."""

    tenant: str
    step: int
    rollouts: tuple[Rollout, ...]
    rewards_sent: int
    corrections_sent: int
    errors: tuple[str, ...]
    seconds: float
    correction_ids: tuple[str, ...] = ()

    @property
    def mean_reward(self) -> float:
        return sum(r.reward for r in self.rollouts) / len(self.rollouts) if self.rollouts else 0.0


def reward_records(rollout: Rollout, key: str = "reward", comment: str | None = None) -> list[FeedbackIn]:
    """The episode's reward on every turn it took (each turn is one interaction), with `comment`
    (the reward's per-rule breakdown, shown in the console) when given."""
    return [FeedbackIn(interaction_id=iid, event_id=f"env-{iid}", source="environment", score=rollout.reward,
                       key=key, comment=comment) for iid in rollout.trace.interaction_ids]


def rules_comment(rules: dict[str, float]) -> str | None:
    """A reward's per-rule breakdown as the console shows it beside the score:
    "state ✓ · info ✗ · identified_first ✓" (None: the reward has no rules)."""
    shown = {k: v for k, v in rules.items() if k != "reward"}
    return " · ".join(f"{k} {'✓' if v >= 1.0 else '✗'}" for k, v in shown.items()) or None


def _call_key(call: dict[str, Any]) -> tuple[str, Any]:
    fn = call.get("function") or {}
    try:
        return fn.get("name"), json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        return fn.get("name"), fn.get("arguments")


def same_action(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two assistant messages say the same thing: equal text (trimmed) and the same
    tool calls with equal parsed arguments (call ids and JSON spacing do not matter)."""
    return ((a.get("content") or "").strip() == (b.get("content") or "").strip()
            and [_call_key(c) for c in a.get("tool_calls") or []] == [_call_key(c) for c in b.get("tool_calls") or []])


class OperatorSimulator:
    """Corrects `share` of the answers it reviews (only wrong ones when `only_wrong`): the
    first turn whose response differs from what the environment says should have followed its
    prompt gets that as a correction, as a reviewer marks where a conversation went off
    course. The later turns of an episode that went wrong (retries after a wrong tool result)
    are not corrected: their prompts hold the agent's own mistakes, which the right path never
    shows. `every_turn=True` corrects every wrong turn. Decisions are seeded by (seed,
    interaction id).

    With `follow` (the tenant's agent), the operator then walks on along the corrected path,
    as a reviewer who fixes a tool call and checks what the agent does with the right result:
    it runs the correction's tool calls, asks the agent for the next turn through the gateway
    (a new interaction, whose prompt is the right path so far) and corrects that turn too when
    it is wrong, until the path ends (a final tool or a plain reply) or `max_follow` turns.
    Without it, a skill's later turns (calc's final_answer after a right calculator result)
    are only ever corrected once the served adapter gets the earlier turns right on its own."""

    def __init__(self, env: TaskEnv, share: float = 0.5, *, only_wrong: bool = True, every_turn: bool = False,
                 seed: int = 0, follow: Agent | None = None, max_follow: int = 2):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"operator share must be in [0, 1], got {share}")
        if max_follow < 0:
            raise ValueError(f"max_follow must be >= 0, got {max_follow}")
        self.env, self.share, self.only_wrong, self.every_turn, self.seed = env, share, only_wrong, every_turn, seed
        self.follow, self.max_follow = follow, max_follow

    def review(self, rollout: Rollout) -> list[FeedbackIn]:
        trace = rollout.trace
        if not trace.turns or (self.only_wrong and rollout.reward >= 1.0):
            return []
        if random.Random(f"{self.seed}/{trace.turns[0].interaction_id}").random() >= self.share:
            return []
        out = []
        for turn in trace.turns:
            prompt = trace.prompt_of(turn)
            fix = self.env.correction(rollout.problem, prompt)
            if same_action(fix, trace.response_of(turn)):
                continue
            out.append(_correction(turn.interaction_id, fix))
            if not self.every_turn:
                return out + self._walk(rollout.problem, prompt, fix)
        return out

    def _walk(self, problem: Problem, prompt: list[dict[str, Any]], fix: dict[str, Any]) -> list[FeedbackIn]:
        """Corrections of the agent's turns along the right path from `prompt` + `fix` on."""
        out: list[FeedbackIn] = []
        for _ in range(self.max_follow if self.follow is not None else 0):
            following = self.env.follow(problem, prompt, fix)
            if following is None:                     # the path ended: a final call or the last reply
                break
            prompt = [*prompt, fix, *following]
            try:
                iid, response = self.follow.respond(prompt)
            except AgentError as e:
                log.warning("operator: could not follow a corrected path: %s", e)
                break
            fix = self.env.correction(problem, prompt)
            if not same_action(fix, response):
                out.append(_correction(iid, fix))
        return out


class ThumbsUser:
    """A user who rates single replies with a thumbs up or down and nothing else: no
    correction, no group, no episode reward. Up when the reply earns at least `bar` of the
    environment's reward (default: every rule met), down otherwise, and a share `noise` of
    the verdicts flipped, as real users misclick and disagree. Each verdict is seeded by
    (seed, interaction id), so a resent step sends the same thumbs. Example: with `noise`
    0.1, a reply that greets the customer by name gets `{"key": "thumbs", "score": 1.0,
    "source": "user"}` nine times in ten."""

    def __init__(self, *, key: str = "thumbs", noise: float = 0.1, bar: float = 1.0, seed: int = 0):
        if not 0.0 <= noise <= 0.5:
            raise ValueError(f"thumbs noise must be in [0, 0.5], got {noise}")
        self.key, self.noise, self.bar, self.seed = key, noise, bar, seed

    def thumbs(self, rollout: Rollout) -> list[FeedbackIn]:
        """One thumbs record per turn of the episode (a single-turn task: one)."""
        out = []
        for iid in rollout.trace.interaction_ids:
            up = rollout.reward >= self.bar
            if random.Random(f"{self.seed}/{iid}").random() < self.noise:
                up = not up
            out.append(FeedbackIn(interaction_id=iid, event_id=f"th-{iid}", source="user",
                                  score=1.0 if up else 0.0, key=self.key))
        return out


def _correction(interaction_id: str, fix: dict[str, Any]) -> FeedbackIn:
    return FeedbackIn(interaction_id=interaction_id, event_id=f"op-{interaction_id}", source="operator",
                      correction=Message.model_validate(fix), key="correction")


class TenantTraffic:
    """One tenant's simulated traffic: group rollouts on its environment, rewards as feedback.
    With a `user`, the user's thumbs replace the environment's rewards: the tenant then hears
    only what production users say."""

    def __init__(self, tenant: str, agent: Agent, env: TaskEnv, feedback: FeedbackClient, *,
                 group_size: int = 4, prompts_per_step: int = 2, concurrency: int = 4,
                 difficulty: Difficulty | None = None, seed: int = 0, operator: OperatorSimulator | None = None,
                 user: ThumbsUser | None = None, group_seed: str | None = None):
        if group_size < 1 or prompts_per_step < 1 or concurrency < 1:
            raise ValueError(f"{tenant}: group_size ({group_size}), prompts_per_step ({prompts_per_step}) and "
                             f"concurrency ({concurrency}) must be >= 1")
        if user is not None and group_size != 1:
            raise ValueError(f"{tenant}: a user rates single replies; group_size must be 1, got {group_size}")
        self.tenant, self.agent, self.env, self.feedback = tenant, agent, env, feedback
        self.group_size, self.prompts_per_step, self.concurrency = group_size, prompts_per_step, concurrency
        self.difficulty, self.seed, self.operator, self.user = difficulty, seed, operator, user
        self.group_seed = group_seed
        """Names step s's k-th group `{group_seed}-{s}-{k}` instead of a random id: two traffics
        with the same group seed (a paired benchmark's two runs of one experiment) hold out the
        same groups, which the buffers choose by group id. None: random ids."""
        self.steps_done = 0

    def _group(self, problem: Problem, name: str | None = None) -> list[Rollout] | str:
        # a user's traffic is single replies, as production's is: no group id, so each thumbed
        # reply is scored alone (a group of one would have no sibling to be compared with)
        group_id = None if self.user else name or f"{self.tenant}-{uuid.uuid4().hex[:16]}"
        try:
            traces = self.agent.run_group(list(problem.messages), self.group_size, group_id=group_id,
                                          session=self.env.session(problem))
        except AgentError as e:
            log.warning("tenant %s: rollout group %s failed: %s", self.tenant, group_id or "(single reply)", e)
            return f"group {group_id or '(single reply)'}: {e}"
        return [Rollout(problem, t, self.env.score(problem, t)) for t in traces]

    def problems_for(self, step: int) -> list[Problem]:
        """The training problems of step `step` (fixed by the traffic's seed)."""
        return self.env.train_problems(self.prompts_per_step, seed=self.seed * 1_000_003 + step,
                                       difficulty=self.difficulty)

    def step(self) -> StepReport:
        started = time.monotonic()
        step = self.steps_done
        problems = self.problems_for(step)
        names = [f"{self.group_seed}-{step}-{k}" if self.group_seed is not None else None
                 for k in range(len(problems))]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            results = list(pool.map(self._group, problems, names))
            rollouts = [r for res in results if not isinstance(res, str) for r in res]
            # a following operator makes model calls of its own: review the rollouts concurrently
            reviews = list(pool.map(self.operator.review, rollouts)) if self.operator else []
        errors = tuple(res for res in results if isinstance(res, str))
        rewards = [rec for r in rollouts
                   for rec in (self.user.thumbs(r) if self.user else reward_records(
                       r, key=self.env.name,
                       comment=rules_comment(self.env.breakdown(r.problem, list(r.trace.messages)))))]
        corrections = [rec for review in reviews for rec in review]
        if rewards or corrections:
            self.feedback.send_batch(rewards + corrections)
        self.steps_done += 1
        return StepReport(self.tenant, step, tuple(rollouts), len(rewards), len(corrections), errors,
                          time.monotonic() - started, tuple(c.event_id for c in corrections))

    def run(self, steps: int, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        reports = []
        for _ in range(steps):
            reports.append(self.step())
            if on_step:
                on_step(reports[-1])
        return reports


def run_tenants(traffic: Sequence[TenantTraffic], steps: int,
                on_step: Callable[[StepReport], None] | None = None) -> dict[str, list[StepReport]]:
    """Run every tenant's traffic for `steps` steps concurrently (one thread per tenant)."""
    with ThreadPoolExecutor(max_workers=max(1, len(traffic))) as pool:
        futures = {t.tenant: pool.submit(t.run, steps, on_step) for t in traffic}
        return {tenant: f.result() for tenant, f in futures.items()}


@dataclass(frozen=True)
class HeldOutScores:
    """Mean greedy reward on an environment's two held-out sets. Example: `same` 1.00 (problems
    phrased as the training traffic is) and `unseen` 0.40 (the same tasks phrased otherwise):
    the adapter learned the templates more than the skill."""

    same: float
    unseen: float


def _greedy_rewards(agent: Agent, env: TaskEnv, problems: Sequence[Problem], concurrency: int) -> list[float]:
    greedy = dataclasses.replace(agent, temperature=0.0)

    def one(p: Problem) -> float:
        return env.score(p, greedy.run(list(p.messages), session=env.session(p)))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, problems))


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def evaluate(agent: Agent, env: TaskEnv, problems: Sequence[Problem] | None = None, *,
             concurrency: int = 4) -> float:
    """Mean reward of greedy (temperature 0) episodes on `problems` (default: the same-template held-out set)."""
    return _mean(_greedy_rewards(agent, env, list(problems if problems is not None else env.held_out()), concurrency))


def evaluate_held_out(agent: Agent, env: TaskEnv, n: int | None = None, *, concurrency: int = 4) -> HeldOutScores:
    """`evaluate` on the first `n` problems (None: all) of both held-out sets in one pass: the
    2n episodes share `concurrency` workers, so the requests in flight (and a tenant's share
    of the engine) stay what one set's evaluation uses, and no worker idles between the sets."""
    same, unseen = env.held_out("same")[:n], env.held_out("unseen")[:n]
    rewards = _greedy_rewards(agent, env, same + unseen, concurrency)
    return HeldOutScores(_mean(rewards[:len(same)]), _mean(rewards[len(same):]))

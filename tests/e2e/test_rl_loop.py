"""On-policy RL through the whole platform, on a tiny model, and the reward rises:

rollout groups through the OpenAI gateway (vLLM samples them and records behaviour
logprobs) -> each episode's reward as feedback through the webhook (source `environment`)
-> Kafka -> ingest joins reward and interaction into RL examples in the tenant's Redis
buffer -> the learner takes a GRPO-style step (group-normalised advantages, clipped
importance ratio against the behaviour logprobs) and publishes a version -> serving
hot-swaps it in -> the next step's rollouts are sampled from that version.

The task is trivially learnable from reward alone: the reply should consist of ASCII
letters (reward = the fraction of its characters that are). A random tiny model with a
byte-level vocabulary writes mostly other bytes, so it starts low.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clora.agents.envs.base import Difficulty, Problem, TaskEnv
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent
from clora.agents.simulate import TenantTraffic
from clora.ids import parse_served_name
from clora.ingest.buffers import BufferPolicy, is_heldout
from clora.learner.losses import has_reward_spread

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANT = "letters"
MAX_STEPS = 24
RISE = 0.25
"""Pass once the mean reward of the last 3 steps beats the first 3 steps' by this much."""


class LettersEnv(TaskEnv):
    """Reply with letters. Reward: the fraction of the reply's characters that are ASCII letters."""

    name = "letters"
    held_out_size = 4

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        key = f"Write some letters ({rng.randrange(10**6)})."
        return Problem(self.name, difficulty, key, ({"role": "user", "content": key},), None,
                       ({"role": "assistant", "content": "abcdefgh"},))

    def reward(self, problem: Problem, answer: str | None) -> float:
        text = answer or ""
        return sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0


def test_rl_from_rewards_raises_the_reward_of_the_served_adapter(platform):
    from openai import OpenAI

    env, admin = platform["env"], {"Authorization": f"Bearer {platform['token']}"}
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", TENANT, "--json"], env=env,
                         capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    group, prompts = 16, 2
    r = httpx.patch(f"{platform['console']}/api/tenants/{TENANT}/policy", headers=admin,
                    json={"algorithm": "rl", "learning_rate": 0.08, "batch_size": group * prompts,
                          "min_new_examples": group, "eval_tolerance": 1.0,
                          "reward_guard": False,    # each step must serve a newer version than the last
                          # a reward for letters on a random tiny model: its replies may well collapse
                          # (the hacking guard's case, tests/e2e/test_hacking_guard.py), and its KL from
                          # the base says nothing
                          "hacking_guard": False, "drift_tolerance": None})
    assert r.status_code == 200, r.text

    client = OpenAI(base_url=platform["gateway"] + "/v1", api_key=key, max_retries=2, timeout=120)
    agent = Agent(client, TENANT, max_turns=1, temperature=1.0, max_tokens=8)
    traffic = TenantTraffic(TENANT, agent, LettersEnv(), FeedbackClient(platform["webhook"], key),
                            group_size=group, prompts_per_step=prompts, concurrency=prompts, seed=7)
    live = lambda: httpx.get(f"{platform['console']}/api/tenants/{TENANT}/versions", headers=admin).json()["live"]
    served = lambda: {m.id: m for m in client.models.list()}[TENANT].model_extra.get("root")

    def served_version() -> int:
        tenant, version = parse_served_name(served())
        return version if tenant == TENANT and version is not None else 0

    history = []                                     # (version the step's rollouts were sampled from, reward)
    flat = []                                        # per step: no trained group had a reward spread
    refused = []                                     # per step: the publish gate refused its candidate
    metrics_url = f"http://127.0.0.1:{env['CLORA_LEARNER_METRICS_PORT']}/metrics"

    def refusals() -> float:
        """How many candidates of TENANT the learner has not published (any refusal outcome)."""
        text = httpx.get(metrics_url).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "clora_learner_publishes_total" and s.labels.get("tenant") == TENANT
                   and s.labels.get("outcome") != "published")

    refused_before = refusals()
    mean = lambda rs: sum(r for _, r in rs) / len(rs)
    holdout = BufferPolicy().holdout_fraction
    while len(history) < MAX_STEPS and not (len(history) >= 6 and mean(history[-3:]) > mean(history[:3]) + RISE):
        version = live()
        report = traffic.step()
        assert not report.errors, report.errors
        assert len(report.rollouts) == group * prompts
        history.append((version, report.mean_reward))
        kept = [r for r in report.rollouts if not is_heldout(r.trace.group_id, holdout)]
        flat.append(not has_reward_spread([r.reward for r in kept], [r.trace.group_id for r in kept]))
        refused.append(False)
        if flat[-1]:  # e.g. every rollout right: the learner consumes the batch without a step
            continue
        # on-policy: the next step waits for the learner to publish from this step's data
        # and for serving to swap that version in. About one run in seven holds a group out
        # (`is_heldout` on a random group id): the publish gate then scores each candidate on
        # those held-out samples' NLL, and may refuse one whose policy moved fast. A refusal
        # publishes nothing; the next step samples the same version again, and the learner
        # trains on from the refused candidate.
        deadline = time.monotonic() + 120
        while (live() or 0) <= (version or 0) and refusals() == refused_before:
            assert time.monotonic() < deadline, f"no version and no refusal after step {len(history)}: {history}"
            time.sleep(0.3)
        refused_before, refused_now = refusals(), refusals() != refused_before
        refused[-1] = refused_now and (live() or 0) <= (version or 0)
        if refused[-1]:
            continue
        new = live()
        deadline = time.monotonic() + 60
        while served_version() < new:   # a late group may train v+2 before the gateway swaps to v+1
            assert time.monotonic() < deadline, f"gateway serves {served()}, live is v{new}"
            time.sleep(0.2)

    versions = [v for v, _ in history]
    # after a step with no reward spread the version may stay, or move on if a late group of the
    # step before trained a second version meanwhile
    assert versions[0] is None and all((b or 0) >= (a or 0) if was_flat or was_refused else (b is not None and (a or 0) < b)
                                       for a, b, was_flat, was_refused in zip(versions, versions[1:], flat, refused)), \
        (f"every step's rollouts must come from a newer version than the last (unless it had no reward spread or "
         f"its candidate was refused): {history}, refused {refused}")
    print("RL history (version, mean reward):", history)
    assert mean(history[-3:]) > mean(history[:3]) + RISE, f"reward did not rise in {MAX_STEPS} steps: {history}"

    # the learner trained on those rewards: its history has RL steps with their mean reward, one
    # per step with a reward spread (a flat batch is consumed without a step; one step's groups
    # may train in two steps, or the step before's late group in the same one: hence the - 1)
    points = httpx.get(f"{platform['console']}/api/tenants/{TENANT}/metrics?n=200", headers=admin).json()["points"]
    trained = sum(1 for p in points if p.get("reward") is not None)
    assert trained >= sum(not f for f in flat) - 1, (f"{trained} RL steps in the learner's history for "
                                                      f"{history}, flat {flat}")

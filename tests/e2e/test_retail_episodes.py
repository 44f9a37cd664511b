"""Long retail conversations through the whole platform, on a tiny model: every turn of an
8-turn episode joins its episode's reward exactly once.

A patient simulated customer keeps answering the tiny model (which never settles its goal), so
each episode runs to its 8 model calls through the gateway, each a served interaction whose
later turns name the episode (`metadata.episode_id`). The episode's reward goes to every turn
through the webhook -> Kafka -> the ingest worker joins each reward to its interaction into
one RL sample in the tenant's Redis buffer (or its held-out set), and the reward tally counts
each episode once, not once per turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import redis

from clora.agents.envs import RetailEnv
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent
from clora.agents.simulate import TenantTraffic
from clora.ingest.buffers import ReplayBuffer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANT = "shop"
TURNS = 8


def test_retail_episodes_join_each_turns_reward_once(platform):
    from openai import OpenAI

    env, admin = platform["env"], {"Authorization": f"Bearer {platform['token']}"}
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", TENANT, "--json"], env=env,
                         capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    r = httpx.patch(f"{platform['console']}/api/tenants/{TENANT}/policy", headers=admin,
                    json={"algorithm": "rl", "min_new_examples": 100_000})   # stored, not trained on
    assert r.status_code == 200, r.text

    client = OpenAI(base_url=platform["gateway"] + "/v1", api_key=key, max_retries=2, timeout=120)
    retail = RetailEnv(patience=TURNS)         # the customer never leaves: episodes run to max_turns
    # no tool schemas in the request: they alone would fill the tiny model's context
    agent = Agent(client, TENANT, max_turns=TURNS, temperature=1.0, max_tokens=8)
    traffic = TenantTraffic(TENANT, agent, retail, FeedbackClient(platform["webhook"], key),
                            group_size=2, prompts_per_step=2, concurrency=2, seed=3)
    report = traffic.step()
    assert report.errors == ()
    episodes = report.rollouts
    assert len(episodes) == 4 and all(len(e.trace.turns) == TURNS for e in episodes)
    assert all(e.trace.stop == "max_turns" for e in episodes)
    roles = [m["role"] for m in episodes[0].trace.messages]
    assert roles.count("user") == TURNS and roles.count("assistant") == TURNS    # it answered back each time
    assert report.rewards_sent == 4 * TURNS

    buffer = ReplayBuffer(redis.Redis(port=int(env["CLORA_REDIS_PORT"])))
    wanted = {iid: (e.trace.interaction_ids[0], e.reward) for e in episodes for iid in e.trace.interaction_ids}

    def stored():
        return buffer.latest(TENANT, "rl", n=1000) + buffer.heldout(TENANT, "rl")

    deadline = time.monotonic() + 120
    while len(stored()) < len(wanted):
        assert time.monotonic() < deadline, f"{len(stored())} of {len(wanted)} turns joined"
        time.sleep(0.5)
    samples = stored()
    assert sorted(s.interaction_id for s in samples) == sorted(wanted)             # every turn, once
    assert all((s.episode_id, s.reward) == wanted[s.interaction_id] for s in samples)
    assert {s.group_id for s in samples} == {e.trace.group_id for e in episodes}
    by_turn = {s.interaction_id: s for s in samples}
    last = by_turn[episodes[0].trace.interaction_ids[-1]]
    assert len([m for m in last.messages if m.role == "user"]) == TURNS           # the whole conversation
    tally = buffer.version_rewards(TENANT)
    assert sum(t.n for t in tally.values()) == len(episodes)                       # an episode counts once

"""The reward guard through the whole platform, on a tiny model:

corrections train two versions (`sft`: the scores below judge versions, they do not train them)
-> each serves answers (pinned by name through the gateway)
-> their rewards arrive as feedback through the webhook -> Kafka -> the ingest worker tallies
them per serving version in Redis -> the learner sees the live version earn less than its
parent and rolls it back -> the gateway serves the parent again under the tenant's name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from clora.ids import served_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANT = "guarded"


def test_a_live_version_that_earns_less_than_its_parent_is_rolled_back(platform, wait_for):
    from openai import OpenAI

    env, admin = platform["env"], {"Authorization": f"Bearer {platform['token']}"}
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", TENANT, "--json"], env=env,
                         capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.patch(f"{platform['console']}/api/tenants/{TENANT}/policy", headers=admin,
                    json={"algorithm": "sft", "batch_size": 4, "min_new_examples": 4, "fresh_fraction": 1.0,
                          "learning_rate": 0.02, "eval_tolerance": 1.0, "reward_guard_min_samples": 4})
    assert r.status_code == 200, r.text
    client = OpenAI(base_url=platform["gateway"] + "/v1", api_key=key, max_retries=0, timeout=120)
    console = f"{platform['console']}/api/tenants/{TENANT}"
    versions = lambda: httpx.get(f"{console}/versions", headers=admin).json()
    served = lambda: {m.id: m for m in client.models.list()}[TENANT].model_extra.get("root")

    def ask(model: str, i: int) -> str:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"colour {i}?"}],
                                              max_tokens=4, temperature=0).id

    def feedback(body: dict) -> None:
        r = httpx.post(platform["webhook"] + "/v1/feedback", headers=auth, json=body, timeout=60)
        assert r.status_code == 202, r.text

    # rounds of 4 corrections until two versions exist. A step takes 4 new examples (and no
    # replayed ones), and ~10% go to the held-out set, so a round makes at most one version and
    # may make none (the next round completes the batch); fewer than 4 wait when it ends, so no
    # step follows the pause below.
    i = 0
    while (versions()["live"] or 0) < 2:
        assert i < 48, versions()
        published = len(versions()["versions"])
        for _ in range(4):
            feedback({"interaction_id": ask(TENANT, i), "source": "operator",
                      "correction": {"role": "assistant", "content": "blue"}})
            i += 1
        deadline = time.monotonic() + 60
        while len(versions()["versions"]) == published and time.monotonic() < deadline:
            time.sleep(0.5)
    assert httpx.post(f"{console}/pause", headers=admin).json()["paused"]     # no more versions from here on
    live = versions()["live"]
    parent = next(v["parent_version"] for v in versions()["versions"] if v["version"] == live)
    assert parent is not None
    wait_for(lambda: served() == served_name(TENANT, live), 60, interval=0.5, what=f"the gateway to serve v{live}")

    # the parent earned 1.0 on what it served, the live version earns 0.0
    for version, score in ((parent, 1.0), (live, 0.0)):
        for _ in range(4):
            feedback({"interaction_id": ask(served_name(TENANT, version), i), "source": "environment", "score": score})
            i += 1
    tallied = lambda v: (next(x for x in versions()["versions"] if x["version"] == v)["served_reward"] or {})
    wait_for(lambda: tallied(parent).get("samples") == 4 and tallied(live).get("samples") == 4, 60,
             interval=0.5, what="the rewards to be tallied per version")
    assert versions()["live"] == live                       # paused: the guard leaves it alone
    assert httpx.post(f"{console}/resume", headers=admin).status_code == 200

    rolled = lambda: next(v for v in versions()["versions"] if v["version"] == live)["rolled_back"]
    note = wait_for(rolled, 60, interval=0.5, what=f"the guard to roll v{live} back")
    by_version = {v["version"]: v for v in versions()["versions"]}
    assert versions()["live"] == parent
    assert note["to"] == parent and note["live_reward"] == 0.0 and note["reference_reward"] == 1.0
    assert by_version[parent]["served_reward"] == {"samples": 4, "mean": 1.0}
    wait_for(lambda: served() == served_name(TENANT, parent), 60, interval=0.5,
             what=f"the gateway to serve v{parent} again")
    points = httpx.get(f"{console}/metrics", headers=admin).json()["points"]
    marks = [p for p in points if "rolled_back" in p]
    assert [(p["rolled_back"], p["live"], p["served_reward"]) for p in marks] == [(live, parent, 0.0)]
    assert "reward" not in marks[0] and "version" not in marks[0]   # not a step's reward, not a publish
    metrics = httpx.get(f"http://127.0.0.1:{env['CLORA_LEARNER_METRICS_PORT']}/metrics").text
    assert f'clora_learner_reward_rollbacks_total{{tenant="{TENANT}"}} 1.0' in metrics

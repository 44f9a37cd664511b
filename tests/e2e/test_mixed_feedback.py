"""A tenant on the default policy (`auto`) whose feedback is what production sends, mixed:
operator corrections, users' thumbs on single answers, and scores its reward spec does not take
(a key it does not name, a key from a source it does not trust). Through the real webhook,
broker, ingest worker, Redis and learner: every kind it takes trains, in the same steps, and a
version ships and serves; what it does not take is stored, counted by reason, and never trained.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from clora.ids import served_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANT = "mixed"


def test_corrections_thumbs_and_untaken_scores_train_one_auto_tenant(platform, wait_for):
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", TENANT, "--json"],
                         env=platform["env"], capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    admin = {"Authorization": f"Bearer {platform['token']}"}
    api = f"{platform['console']}/api/tenants/{TENANT}"
    assert httpx.get(api, headers=admin).json()["policy"]["algorithm"] == "auto"     # the default
    r = httpx.patch(f"{api}/policy", headers=admin, json={
        "batch_size": 4, "min_new_examples": 1, "learning_rate": 0.02, "eval_tolerance": 1.0,
        "reward_spec": {"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}}})
    assert r.status_code == 200, r.text
    # paused while the feedback arrives, so that every kind waits in the buffer for the same steps
    assert httpx.post(f"{api}/pause", headers=admin).json()["paused"]

    client = OpenAI(base_url=platform["gateway"] + "/v1", api_key=key, max_retries=0, timeout=120)
    hook = {"Authorization": f"Bearer {key}"}
    sent = {"correction": 0, "thumbs": 0, "unknown_key": 0, "untrusted_source": 0}
    for i in range(16):
        resp = client.chat.completions.create(model=TENANT, messages=[{"role": "user", "content": f"pet {i}?"}],
                                              max_tokens=6, temperature=1.0, seed=i)
        kind = ("correction", "thumbs", "unknown_key", "untrusted_source")[i % 4]
        body = {"correction": {"interaction_id": resp.id, "source": "operator",
                               "correction": {"role": "assistant", "content": "a cat"}},
                "thumbs": {"interaction_id": resp.id, "source": "user", "key": "thumbs", "score": float(i % 8 == 1)},
                "unknown_key": {"interaction_id": resp.id, "source": "user", "key": "stars", "score": 4},
                "untrusted_source": {"interaction_id": resp.id, "source": "environment", "key": "thumbs",
                                     "score": 1}}[kind]
        fb = httpx.post(platform["webhook"] + "/v1/feedback", headers=hook, json=body, timeout=60)
        assert fb.status_code == 202, fb.text
        sent[kind] += 1

    buffers = lambda: httpx.get(f"{api}/buffers", headers=admin).json()
    untrained = lambda: httpx.get(api, headers=admin).json()["untrained_feedback"]
    wait_for(lambda: untrained() == {"unknown_key": 4, "untrusted_source": 4}, 120, interval=0.5,
             what=f"the untaken scores counted (now {untrained()})")
    stored = lambda: buffers()["stats"].get("added", 0)
    # each correction makes an SFT example and a pair (the random model never answers "a cat"),
    # each thumb one scored sample; the untaken scores none
    wait_for(lambda: stored() == 2 * sent["correction"] + sent["thumbs"], 120, interval=0.5,
             what=f"the trainable examples stored (now {buffers()['stats']})")
    depth = buffers()["depth"]
    trainable = depth["sft"] + depth["preference"] + depth["rl"]     # the rest went to the held-out set
    assert depth["sft"] > 0 and depth["preference"] > 0 and depth["rl"] > 0, depth

    assert not httpx.post(f"{api}/resume", headers=admin).json()["paused"]
    versions = lambda: httpx.get(f"{api}/versions", headers=admin).json()["versions"]
    # every example trained once (auto takes the oldest past the cursor over all kinds), so the
    # newest version has seen them all: corrections, pairs and thumbs in the same steps
    wait_for(lambda: versions() and max(v["examples_seen"] for v in versions()) == trainable, 300, interval=0.5,
             what=f"a version trained on all {trainable} examples ({[v['examples_seen'] for v in versions()]})")
    steps = [p for p in httpx.get(f"{api}/metrics?n=500", headers=admin).json()["points"] if p.get("loss") is not None]
    assert len(steps) == -(-trainable // 4), steps                   # batch 4, nothing trained twice
    assert any(p.get("reward") is not None for p in steps)            # a step held the thumbs

    live = httpx.get(f"{api}/versions", headers=admin).json()["live"]
    resp = client.chat.completions.create(model=served_name(TENANT, live),
                                          messages=[{"role": "user", "content": "pet?"}], max_tokens=4)
    assert resp.model == served_name(TENANT, live)

"""`clora demo` — the README's first command — runs end to end, as a user runs it, on a tiny
model: it brings up every real service, creates its four tenants, measures the base model,
drives traffic with rewards, operator corrections and a user's thumbs through the webhook, lets the learner
train and publish, evaluates the live adapters and writes its report.

A random tiny model cannot learn the tasks in a couple of minutes; what this checks is the
wiring and the report. How well the demo teaches SmolLM2 is measured by running it (README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from clora.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_runs_the_platform_and_reports_every_tenant(tmp_path, tiny_model):
    model = tiny_model
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")}
    env.update({f"CLORA_{k}": str(free_port()) for k in ("BROKER_PORT", "REDIS_PORT", "WEBHOOK_PORT",
                                                         "INGEST_METRICS_PORT", "CONSOLE_PORT", "GATEWAY_PORT",
                                                         "LEARNER_METRICS_PORT", "GATEWAY_METRICS_PORT",
                                                         "TRAINAPI_PORT")})
    env.update(CLORA_DATA_DIR=str(tmp_path / "data"), CLORA_ENGINE_MODEL=str(model),
               CLORA_LEARNER_BASE_MODEL=str(model), CLORA_ENGINE_PORTS=json.dumps([free_port()]),
               CLORA_ENGINE_MAX_MODEL_LEN="1024", CLORA_LEARNER_RANK="4", CLORA_LEARNER_ALPHA="8")
    budget_min = 2.5
    run = subprocess.run([sys.executable, "-m", "clora.infra.cli", "demo", "--minutes", str(budget_min),
                          "--eval-size", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "held-out score, base model vs final adapter" in run.stdout

    report = json.loads((tmp_path / "bench-results" / "demo.json").read_text())
    rows = {r["tenant"]: r for r in report["tenants"]}
    assert set(rows) == {"calc", "support", "extract", "greet"}
    for r in rows.values():
        assert 0.0 <= r["base_score"] <= 1.0 and 0.0 <= r["score"] <= 1.0, r
        assert r["rollouts"] > 0 and r["errors"] == 0, r
    # the random model answers wrong, so the operator corrects it and the learner trains
    assert sum(r["corrections"] for r in rows.values()) > 0
    # the thumbs tenant hears only thumbs: one per reply, no corrections
    greet = rows["greet"]
    assert greet["thumbs"] == greet["rollouts"] > 0 and greet["corrections"] == 0, greet
    assert all(r["thumbs"] == 0 for t, r in rows.items() if t != "greet"), rows
    # feedback -> served: a number of seconds for a tenant whose trained version served, else none
    assert all(r["freshness_p50"] is None or r["freshness_p50"] > 0 for r in rows.values()), rows
    assert any(r["learner_steps"] > 0 for r in rows.values()), rows
    phases = report["phases"]
    assert set(phases) == {"startup_s", "base_eval_s", "learning_s", "final_eval_s", "total_s"}
    assert phases["learning_s"] > 0
    # every demo run starts from nothing in its own data folder
    assert len(list((tmp_path / "data" / "demo").iterdir())) == 1

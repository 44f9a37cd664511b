"""`clora up` with the Tinker-compatible training API: `clora trainapi` runs as a supervised
service on its own port, the learner and it agree on the base model, the tokenizer folder and
the checkpoints folder (under the platform's data dir), and an SDK run through it trains on the
learner process behind it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from rich.console import Console

from clora.learner.base_model import make_tiny_model
from clora.procs import free_port
from clora.registry import Registry
from tests.infra.harness import running_platform

SCRIPT = Path(__file__).parents[1] / "trainapi" / "sdk_conformance.py"
SHARED = ("CLORA_TRAINAPI_CHECKPOINTS_DIR", "CLORA_TRAINAPI_BASE_MODEL", "CLORA_TRAINAPI_TOKENIZER_ID")


@pytest.mark.integration
@pytest.mark.slow
def test_the_platform_runs_the_training_api_beside_the_learner_and_an_sdk_run_trains_through_it(tmp_path, wait_for):
    pytest.importorskip("tinker")
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    port = free_port()
    with running_platform(tmp_path / "data", ["learner", "trainapi"], CLORA_LEARNER_BASE_MODEL=str(model),
                          CLORA_LEARNER_METRICS_PORT="0", CLORA_LEARNER_IDLE_SLEEP_S="0.2",
                          CLORA_TRAINAPI_PORT=str(port), CLORA_GATEWAY_PORT=str(free_port())) as platform:
        url = platform.urls()["trainapi"]
        assert url == f"http://127.0.0.1:{port}" and httpx.get(f"{url}/api/v1/healthz").status_code == 200
        envs = {name: psutil.Process(platform.services[name].proc.pid).environ() for name in ("learner", "trainapi")}
        assert {k: envs["learner"][k] for k in SHARED} == {k: envs["trainapi"][k] for k in SHARED} == {
            "CLORA_TRAINAPI_CHECKPOINTS_DIR": str((tmp_path / "data").resolve() / "trainapi" / "checkpoints"),
            "CLORA_TRAINAPI_BASE_MODEL": str(model),          # the name the learner records versions under
            "CLORA_TRAINAPI_TOKENIZER_ID": str(model.resolve())}
        assert envs["trainapi"]["CLORA_TRAINAPI_GATEWAY_URL"] == platform.urls()["gateway"]
        out = io.StringIO()
        platform.print_summary(Console(file=out, width=200))
        assert f"Tinker API        {url}" in out.getvalue()

        registry = Registry(redis.Redis.from_url(platform.stack.redis_url))
        registry.create_tenant("acme")
        key = registry.create_tinker_key("acme")
        done = subprocess.run([sys.executable, str(SCRIPT), "--base-url", url, "--api-key", key, "--base-model",
                               str(model), "--rank", "8", "--out", str(tmp_path / "result.json")],
                              env={**os.environ, "TINKER_TELEMETRY": "0"}, capture_output=True,
                              text=True, timeout=300)
        learner_log = (tmp_path / "data" / "logs" / "learner.log").read_text()
        assert done.returncode == 0, done.stderr[-4000:] + learner_log[-4000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["info"]["tokenizer_id"] == str(model.resolve())
        # the learner process wrote the save where the training API process reads it
        run = tmp_path / "data" / "trainapi" / "checkpoints" / "acme" / result["info"]["model_id"]
        assert (run / "weights" / "conformance").is_dir() and (run / "sampler_weights" / "conformance-sampler").is_dir()


def test_run_apart_the_learner_and_the_training_api_default_to_the_learners_base_model(tmp_path, monkeypatch):
    from clora.infra.cli import _trainapi_defaults

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    monkeypatch.setenv("CLORA_LEARNER_BASE_MODEL", str(model))
    for name in SHARED:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLORA_TRAINAPI_TOKENIZER_ID", "/models/explicit")      # set explicitly: kept
    _trainapi_defaults()
    assert os.environ["CLORA_TRAINAPI_BASE_MODEL"] == str(model)
    assert os.environ["CLORA_TRAINAPI_TOKENIZER_ID"] == "/models/explicit"
    monkeypatch.delenv("CLORA_TRAINAPI_TOKENIZER_ID")
    _trainapi_defaults()
    assert os.environ["CLORA_TRAINAPI_TOKENIZER_ID"] == str(model.resolve())

"""The platform the end-to-end tests share: one `clora up` (every real service, in a child
process) on a tiny model, started once for tests/e2e because vLLM takes ~20 s to start."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clora.procs import free_port, http_ok

_spec = importlib.util.spec_from_file_location("clora_e2e_tiny", Path(__file__).parents[1] / "serving" / "tiny.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level tokenizer (tests/serving/tiny.py), built once."""
    return tiny.make_model(tmp_path_factory.mktemp("e2e-model") / "model")


@pytest.fixture(scope="package")  # stopped after tests/e2e, not left running beside the later tests
def platform(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("e2e")
    model = tiny_model
    ports = {k: free_port() for k in ("BROKER_PORT", "REDIS_PORT", "WEBHOOK_PORT", "INGEST_METRICS_PORT",
                                      "CONSOLE_PORT", "GATEWAY_PORT", "LEARNER_METRICS_PORT", "GATEWAY_METRICS_PORT",
                                      "TRAINAPI_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")}
    env.update({f"CLORA_{k}": str(v) for k, v in ports.items()})
    env.update(CLORA_DATA_DIR=str(root / "data"), CLORA_ENGINE_MODEL=str(model), CLORA_LEARNER_BASE_MODEL=str(model),
               CLORA_ENGINE_PORTS=json.dumps([free_port()]), CLORA_ENGINE_MAX_MODEL_LEN="2048",
               CLORA_ENGINE_MAX_LORA_RANK="8", CLORA_LEARNER_RANK="4", CLORA_LEARNER_ALPHA="8",
               CLORA_LEARNER_IDLE_SLEEP_S="0.2", CLORA_GATEWAY_REGISTRY_POLL_S="0.2",
               # the RL tests send two groups of 16 at once: the whole engine (1 replica x 32
               # sequences), more than the default half a tenant may hold (429 when they overlap)
               CLORA_GATEWAY_TENANT_ENGINE_SHARE="1.0")
    # 2048: a retail conversation of 8 turns on the byte-level tokenizer (test_retail_episodes)
    log = root / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "clora.infra.cli", "up"], env=env, stdout=open(log, "wb"),
                          stderr=subprocess.STDOUT)
    gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
    try:
        deadline_ok = wait(lambda: up.poll() is not None or http_ok(gateway + "/health"), 400)
        assert deadline_ok and up.poll() is None, log.read_text()[-4000:]
        yield {"env": env, "gateway": gateway, "webhook": f"http://127.0.0.1:{ports['WEBHOOK_PORT']}",
               "console": f"http://127.0.0.1:{ports['CONSOLE_PORT']}", "root": root, "model": model,
               "trainapi": f"http://127.0.0.1:{ports['TRAINAPI_PORT']}",
               "token": (root / "data" / "admin_token").read_text().strip()}
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)


def wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False

"""Every service's listeners bind a configured address: the HTTP services' `host` and the
Prometheus endpoints' `metrics_host` come from the environment, and no metrics listener binds an
address written in the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "ingest", "learner", "serving", "trainapi", "infra", "agents")


@pytest.mark.parametrize("module, model, prefix", [
    ("clora.ingest.settings", "IngestSettings", "CLORA_INGEST_"),
    ("clora.learner.settings", "LearnerSettings", "CLORA_LEARNER_"),
    ("clora.serving.settings", "GatewaySettings", "CLORA_GATEWAY_"),
])
def test_metrics_host_comes_from_the_environment(monkeypatch, module, model, prefix):
    import importlib

    settings = getattr(importlib.import_module(module), model)
    assert settings().metrics_host == "127.0.0.1"
    monkeypatch.setenv(f"{prefix}METRICS_HOST", "0.0.0.0")
    assert settings().metrics_host == "0.0.0.0"


@pytest.mark.parametrize("module, model, prefix", [
    ("clora.ingest.settings", "WebhookSettings", "CLORA_WEBHOOK_"),
    ("clora.infra.settings", "ConsoleSettings", "CLORA_CONSOLE_"),
    ("clora.serving.settings", "GatewaySettings", "CLORA_GATEWAY_"),
    ("clora.serving.settings", "EngineSettings", "CLORA_ENGINE_"),
    ("clora.trainapi.settings", "TrainApiSettings", "CLORA_TRAINAPI_"),
])
def test_every_http_service_host_comes_from_the_environment(monkeypatch, module, model, prefix):
    import importlib

    settings = getattr(importlib.import_module(module), model)
    monkeypatch.setenv(f"{prefix}HOST", "0.0.0.0")
    assert settings().host == "0.0.0.0"


def _metrics_listeners() -> list[tuple[str, ast.Call]]:
    calls = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) \
                        == "start_http_server":
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", node))
    return calls


def test_every_metrics_listener_binds_its_settings_metrics_host():
    calls = _metrics_listeners()
    assert len(calls) >= 3          # the ingest worker, the learner, the gateway
    for where, call in calls:
        addr = next((k.value for k in call.keywords if k.arg == "addr"), None)
        assert isinstance(addr, ast.Attribute) and addr.attr == "metrics_host", \
            f"{where}: start_http_server must bind addr=<settings>.metrics_host"

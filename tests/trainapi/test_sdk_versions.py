"""Each supported `tinker` SDK version passes the conformance run (`sdk_conformance.py`) against
the training API: the test extras' 0.38 under this interpreter, and 0.30 under the interpreter
`CLORA_TINKER_OLD_PYTHON` names (skipped when unset; `.ci/run` makes that virtualenv and sets it,
so CI runs both). The script runs as a subprocess, so each version is the SDK exactly as a user
installs it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

pytestmark = pytest.mark.integration   # the service fixture runs on the suite's Redis

SCRIPT = Path(__file__).with_name("sdk_conformance.py")
OLD_PYTHON = "CLORA_TINKER_OLD_PYTHON"
"""A Python with an older tinker SDK (0.30.0 in CI) and nothing of clora."""
TIMEOUT_S = 300


def conformance(python: str, service, key: str, out: Path) -> subprocess.CompletedProcess:
    """Run the conformance script under `python` against the service with `key`."""
    return subprocess.run(
        [python, str(SCRIPT), "--base-url", service.url, "--api-key", key, "--base-model", service.base_model,
         "--rank", str(service.rank), "--out", str(out)],
        env={**os.environ, "TINKER_TELEMETRY": "0"}, capture_output=True, text=True, timeout=TIMEOUT_S)


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def sdk_python(sdk: str) -> str:
    if sdk == "current":
        return sys.executable
    old = os.environ.get(OLD_PYTHON)
    if not old:
        pytest.skip(f"{OLD_PYTHON} is unset (.ci/run sets it to a virtualenv with tinker==0.30.0)")
    return old


@pytest.mark.parametrize("sdk", ["current", "old"])
def test_each_sdk_version_trains_saves_restores_and_exports_a_run(service, sdk, tmp_path):
    python = sdk_python(sdk)
    done = conformance(python, service, service.keys["acme"], tmp_path / "result.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    current = importlib.metadata.version("tinker")
    if sdk == "current":
        assert result["sdk_version"] == current
    else:   # the old interpreter really holds an older SDK
        assert release(result["sdk_version"]) < release(current), (result["sdk_version"], current)
    assert result["error"] is None
    losses = result["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    model_id = result["info"]["model_id"]
    assert result["checkpoint_path"] == f"tinker://{model_id}/weights/conformance"
    assert result["sampler_path"] == f"tinker://{model_id}/sampler_weights/conformance-sampler"
    assert result["resumed_info"]["model_id"] != model_id
    assert result["resumed_loss_at_save"] == pytest.approx(result["loss_at_save"], rel=1e-4)
    assert (result["info"]["model_name"], result["info"]["lora_rank"]) == (service.base_model, service.rank)


def test_the_conformance_script_fails_loudly_on_a_key_the_server_refuses(service, tmp_path):
    done = conformance(sys.executable, service, "tml-not-a-key-of-anyone", tmp_path / "result.json")
    assert done.returncode == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] and "losses" not in result
    assert f"sdk_conformance (tinker {result['sdk_version']}) FAILED: " in done.stderr

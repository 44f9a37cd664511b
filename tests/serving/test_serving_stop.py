"""`clora serve` told to stop while its engine boots: it stops at once and takes its vLLM
replica with it. (Before, a SIGTERM during the start was only noticed once the engine was up,
minutes later on a busy CPU, and a parent that had died meanwhile left both running, holding
their ports.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from clora.procs import free_port

from tests.serving import tiny

pytestmark = pytest.mark.integration


def test_a_sigterm_while_the_engine_boots_stops_serving_and_its_replica(tmp_path, wait_for):
    model = tiny.make_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")}
    env.update(CLORA_DATA_DIR=str(tmp_path / "data"), CLORA_ENGINE_MODEL=str(model),
               CLORA_ENGINE_PORTS=json.dumps([free_port()]), CLORA_ENGINE_MAX_MODEL_LEN="512",
               CLORA_GATEWAY_PORT=str(free_port()), CLORA_GATEWAY_METRICS_PORT=str(free_port()),
               CLORA_BROKER_PORT=str(free_port()), CLORA_REDIS_PORT=str(free_port()))
    serve = subprocess.Popen([sys.executable, "-m", "clora.infra.cli", "serve"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        me = psutil.Process(serve.pid)

        def replica() -> psutil.Process | None:
            return next((c for c in me.children(recursive=True)
                         if "vllm.entrypoints.openai.api_server" in " ".join(c.cmdline())), None)

        wait_for(lambda: replica() is not None or serve.poll() is not None, timeout=60, what="the replica's spawn")
        engine = replica()
        assert engine is not None, serve.stderr.read()
        assert not _listening(env["CLORA_GATEWAY_PORT"])         # still booting: nothing serves yet
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=300) == 0
        log = serve.stderr.read()
        # it stopped where it was: the engine never finished booting, the gateway never listened
        assert "gateway listening" not in log, log[-3000:]
        wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, timeout=60,
                 what="the replica to stop with its parent")
    finally:
        if serve.poll() is None:
            serve.kill()


def _listening(port: str) -> bool:
    from clora.procs import port_open

    return port_open("127.0.0.1", int(port))

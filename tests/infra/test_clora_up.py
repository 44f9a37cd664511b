"""`clora up` as a user runs it: the whole ingest platform comes up, the CLI creates a
tenant, feedback is accepted, Ctrl-C (SIGTERM) stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from clora.procs import free_port, port_open
from tests.keepalive import closed_after_idle

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_clora_up_runs_and_stops_cleanly(tmp_path, wait_for):
    ports = {k: free_port() for k in ("CLORA_BROKER_PORT", "CLORA_REDIS_PORT", "CLORA_WEBHOOK_PORT",
                                      "CLORA_INGEST_METRICS_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")}
    env.update({k: str(v) for k, v in ports.items()}, CLORA_DATA_DIR=str(tmp_path / "data"),
               CLORA_SERVICES='["webhook", "ingest", "console"]', CLORA_CONSOLE_PORT=str(console := free_port()))
    clora = [sys.executable, "-m", "clora.infra.cli"]
    up = subprocess.Popen([*clora, "up"], env=env, stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: port_open("127.0.0.1", ports["CLORA_INGEST_METRICS_PORT"]) or up.poll() is not None,
                 timeout=90, what="clora up to start everything")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        out = subprocess.run([*clora, "tenant", "create", "acme", "--json"], env=env, capture_output=True,
                             text=True, check=True)
        key = json.loads(out.stdout)["api_key"]
        listing = subprocess.run([*clora, "tenant", "list"], env=env, capture_output=True, text=True, check=True)
        assert "acme" in listing.stdout and key not in listing.stdout
        _versions_through_the_cli(clora, env, ports["CLORA_REDIS_PORT"])
        r = httpx.post(f"http://127.0.0.1:{ports['CLORA_WEBHOOK_PORT']}/v1/feedback",
                       headers={"Authorization": f"Bearer {key}"}, json={"interaction_id": "x", "score": 1.0}, timeout=60)
        assert r.status_code == 202, r.text
        # clients reuse an idle connection for up to 5 s (httpx, the openai SDK): the servers
        # `clora up` runs must keep it open longer, or a request on it can meet the close
        urls = [f"http://127.0.0.1:{ports['CLORA_WEBHOOK_PORT']}/healthz", f"http://127.0.0.1:{console}/console/"]
        assert closed_after_idle(urls, 5.5) == []
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 4                   # broker, redis, webhook, ingest worker
        summary = (tmp_path / "up.log").read_text()
        assert "clora is up" in summary and "logs" in summary
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    assert up.returncode == 0
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert (tmp_path / "data" / "redis" / "appendonlydir").exists() or list((tmp_path / "data" / "redis").glob("*.aof"))


def _versions_through_the_cli(clora: list[str], env: dict, redis_port: int) -> None:
    """`clora tenant versions / rollback / promote` go through the console's API."""
    import redis

    from clora.registry import AdapterVersion, Registry

    registry = Registry(redis.Redis(port=redis_port))
    for v in (1, 2, 3):
        registry.record_adapter_version("acme", AdapterVersion(
            version=v, path=f"/adapters/acme/v{v}", base_model="tiny", parent_version=v - 1 if v > 1 else None,
            step=10 * v, examples_seen=40 * v, eval_scores={"eval_loss": 1.0 / v}))
    registry.set_live_version("acme", 3)
    registry.mark_rolled_back("acme", 2, {"to": 1, "reason": "mean reward 0.100 over 12 samples vs v1's 0.900"})
    cli = lambda *args: subprocess.run([*clora, "tenant", *args], env=env | {"COLUMNS": "300"},  # no wrapping
                                       capture_output=True, text=True)
    listing = cli("versions", "acme", "--json")
    assert listing.returncode == 0, listing.stderr
    data = json.loads(listing.stdout)
    assert data["live"] == 3 and [v["version"] for v in data["versions"]] == [1, 2, 3]
    table = cli("versions", "acme").stdout
    assert "v3 (live)" in table and "rolled back to v1 by the reward guard" in table and "0.3333" in table
    assert cli("rollback", "acme").stdout.strip() == "acme: v2 is live" and registry.live_version("acme") == 2
    assert cli("rollback", "acme", "--to", "1").stdout.strip() == "acme: v1 is live"
    assert cli("promote", "acme", "3").stdout.strip() == "acme: v3 is live" and registry.live_version("acme") == 3
    missing = cli("promote", "acme", "9")
    assert missing.returncode == 3 and "no adapter version 9" in missing.stderr      # 3: not found
    unknown = cli("versions", "nobody")
    assert unknown.returncode == 3 and "nobody" in unknown.stderr

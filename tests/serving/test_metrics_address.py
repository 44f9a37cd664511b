"""The gateway's Prometheus endpoint binds `CLORA_GATEWAY_METRICS_HOST`: the loopback by default,
every address when a scraper outside the container needs it. Unit test: no engine is started."""

from __future__ import annotations

import urllib.request

import pytest

from clora.serving.metrics import GatewayMetrics
from clora.serving.service import ServingService
from clora.serving.settings import EngineSettings, GatewaySettings


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_gateway_metrics_listen_on_the_configured_address(host):
    service = ServingService(EngineSettings(), GatewaySettings(metrics_host=host, metrics_port=0),
                             kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0")
    server = service._export(GatewayMetrics())
    try:
        assert server.server_address[0] == host
        with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5) as r:
            assert b"clora_gateway_requests" in r.read()
    finally:
        server.shutdown()
        server.server_close()

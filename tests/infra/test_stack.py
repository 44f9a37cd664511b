"""The embedded stack: it starts the real broker and Redis, and starts nothing when given
external URLs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_stack_services_answer(stack, redis_client):
    from kafka import KafkaAdminClient

    assert redis_client.ping()
    assert redis_client.config_get("appendonly")["appendonly"] == "yes"
    admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap)
    assert {"clora.feedback", "clora.interactions", "clora.dlq", "clora.adapters"} <= set(admin.list_topics())
    admin.close()
    assert all(p.exists() for p in stack.log_paths().values())


def test_external_urls_start_nothing(tmp_path, stack):
    from clora.settings import PlatformSettings
    from clora.infra.stack import LocalStack

    ext = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=stack.kafka_bootstrap,
                                               redis_url=stack.redis_url))
    with ext:
        assert ext.processes == {}
        assert ext.kafka_bootstrap == stack.kafka_bootstrap and ext.redis_url == stack.redis_url
    assert not (tmp_path / "logs").exists()

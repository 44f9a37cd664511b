"""Shared fixtures: the real embedded broker and Redis, started once per test session.

`stack` starts Tansu and redis-server on free ports under a temporary data dir (or uses
CLORA_KAFKA_BOOTSTRAP / CLORA_REDIS_URL when set). Tests isolate themselves by tenant id
(`tenant_id` fixture), never by flushing state another test may be reading.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("CLORA_TEST_ARTIFACTS", "test-artifacts"))


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from clora.infra.settings import BrokerSettings, PlatformSettings, RedisSettings
    from clora.infra.stack import LocalStack
    from clora.infra.supervisor import free_port
    from clora.ingest.producer import ensure_topics

    data = tmp_path_factory.mktemp("clora-data")
    s = LocalStack(
        platform=PlatformSettings(data_dir=data),
        broker=BrokerSettings(port=free_port()),
        redis=RedisSettings(port=free_port()),
    )
    s.start()
    ensure_topics(s.kafka_bootstrap, partitions=s.broker.partitions)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_client(stack):
    import redis

    client = redis.Redis.from_url(stack.redis_url)
    yield client
    client.close()


@pytest.fixture
def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def registry(redis_client):
    from clora.infra.registry import Registry

    return Registry(redis_client)

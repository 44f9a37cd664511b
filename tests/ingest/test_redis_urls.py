"""A Redis URL with a user and password reaches the server as given, from the clients the ingest
worker and the webhook build: against the suite's real Redis, with an ACL user made for the test
(the default user, which other tests use, is left alone)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from clora.ingest.settings import IngestSettings
from clora.ingest.webhook import async_redis_client
from clora.ingest.worker import IngestWorker

pytestmark = pytest.mark.integration


@pytest.fixture
def acl_user(redis_client):
    """(user, password) of a Redis user that may do anything; deleted afterwards."""
    user, password = f"clora-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    redis_client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])
    yield user, password
    redis_client.acl_deluser(user)


def _text(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply


def _url(stack, user: str, password: str) -> str:
    return stack.redis_url.replace("redis://", f"redis://{user}:{password}@", 1)


def test_the_services_clients_log_in_as_the_urls_user(stack, acl_user):
    user, password = acl_user
    url = _url(stack, user, password)
    worker = IngestWorker(IngestSettings(), stack.kafka_bootstrap, url)
    try:
        assert _text(worker.r.acl_whoami()) == user
    finally:
        worker.r.close()

    async def whoami() -> str:
        client = async_redis_client(url)
        try:
            return _text(await client.acl_whoami())
        finally:
            await client.aclose()
    assert asyncio.run(whoami()) == user


def test_a_wrong_password_is_refused(stack, acl_user):
    user, _ = acl_user
    client = redis.Redis.from_url(_url(stack, user, "wrong"))
    with pytest.raises(redis.AuthenticationError):
        client.ping()

"""The webhook's and training API's asyncio Redis client under a burst: more commands at once
than it has connections wait for one, instead of failing with redis-py's "Too many
connections" (which answered a burst of feedback requests 503); on the suite's real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from clora.ingest.webhook import REDIS_CONNECTIONS, async_redis_client

pytestmark = pytest.mark.integration


def test_more_concurrent_commands_than_connections_wait_for_one_and_all_succeed(stack):
    async def go() -> list:
        r = async_redis_client(stack.redis_url)
        key = f"empty-{uuid.uuid4().hex}"
        try:   # each BLPOP holds its connection for 0.2 s: all of them are in flight at once
            return await asyncio.gather(*(r.blpop([key], timeout=0.2) for _ in range(2 * REDIS_CONNECTIONS + 30)))
        finally:
            await r.aclose()

    assert asyncio.run(go()) == [None] * (2 * REDIS_CONNECTIONS + 30)

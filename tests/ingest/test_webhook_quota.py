"""The webhook's per-tenant quota over real HTTP and the real Redis: past its records/s or
bytes/s a tenant gets 429 with Retry-After, the count is shared by every webhook instance, and
one tenant over its quota leaves the others alone. The broker is a recording stand-in: the
quota is charged before anything is produced."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.integration


class RecordingProducer:
    """Acknowledges every write at once and keeps it."""

    def __init__(self):
        self.sent: list[tuple[str, str]] = []

    async def send_many_and_wait(self, topic: str, records: list[tuple[str, str]]) -> None:
        self.sent.extend(records)

    def close(self) -> None:
        pass


@pytest.fixture
def webhooks(stack):
    """Two webhook instances on the same Redis, each allowing 20 records and 4 KiB per 10 s."""
    import contextlib

    import redis

    from clora.ingest.settings import WebhookSettings
    from clora.ingest.webhook import async_redis_client, create_app
    from clora.registry import Registry
    from tests.fakes import ServerThread

    settings = WebhookSettings(max_body_bytes=4096, max_batch=20, auth_cache_s=0, quota_events_per_s=2,
                               quota_bytes_per_s=410, quota_window_s=10)
    with contextlib.ExitStack() as servers:
        yield [servers.enter_context(ServerThread(create_app(
            settings, Registry(redis.Redis.from_url(stack.redis_url)), RecordingProducer(),
            async_redis=async_redis_client(stack.redis_url)), lifespan="auto")) for _ in range(2)]


def send(server, key: str, records: int, comment: str = "ok") -> httpx.Response:
    body = {"records": [{"interaction_id": f"q-{i}", "score": 1.0, "comment": comment} for i in range(records)]}
    return httpx.post(f"{server.url}/v1/feedback/batch", headers={"Authorization": f"Bearer {key}"}, json=body)


def assert_over_quota(r: httpx.Response, what: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "quota_exceeded" and what in r.json()["error"]["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 10


def test_records_past_the_quota_are_429_on_every_instance_and_other_tenants_are_untouched(webhooks, registry,
                                                                                          tenant_id):
    a, b = webhooks
    _, busy = registry.create_tenant(tenant_id)
    _, quiet = registry.create_tenant(tenant_id + "-q")
    assert send(a, busy, 12).status_code == 202
    assert send(b, busy, 8).status_code == 202            # the other instance counts the same 20
    assert_over_quota(send(a, busy, 1), "records")
    assert_over_quota(send(b, busy, 1), "records")
    assert send(b, quiet, 20).status_code == 202          # a tenant of its own quota


def test_bytes_past_the_quota_are_429(webhooks, registry, tenant_id):
    a, _ = webhooks
    _, key = registry.create_tenant(tenant_id)
    big = "x" * 1500
    assert len(json.dumps({"records": [{"interaction_id": "q-0", "score": 1.0, "comment": big}]})) > 1500
    assert send(a, key, 1, big).status_code == 202
    assert send(a, key, 1, big).status_code == 202
    assert_over_quota(send(a, key, 1, big), "bytes")      # 3 x ~1.5 KB > 4.1 KB per 10 s


def test_the_quota_must_admit_the_largest_request():
    from pydantic import ValidationError

    from clora.ingest.settings import WebhookSettings

    with pytest.raises(ValidationError, match="at least max_batch"):
        WebhookSettings(max_batch=1000, quota_events_per_s=10, quota_window_s=10)
    with pytest.raises(ValidationError, match="at least max_body_bytes"):
        WebhookSettings(max_body_bytes=1 << 20, quota_bytes_per_s=1024, quota_window_s=10)


def test_concurrent_requests_are_charged_together_and_each_gets_its_own_verdict(stack, tenant_id):
    """A tenant's requests waiting on the same charge are counted in one hit per limit while
    they all fit; past the quota each is charged alone: exactly the quota's worth is admitted,
    as one at a time would give, and each refusal says when to retry."""
    import asyncio

    from clora.ingest.settings import WebhookSettings
    from clora.ingest.webhook import TenantQuota, async_redis_client
    from clora.web import HttpError

    async def run() -> tuple[list, int, list, int]:
        client = async_redis_client(stack.redis_url)
        quota = TenantQuota(client, WebhookSettings(quota_events_per_s=2, quota_bytes_per_s=10**6,
                                                    quota_window_s=10, max_batch=20))
        hits = 0
        hit = quota.limiter.hit

        async def counted(*args, **kwargs):
            nonlocal hits
            hits += 1
            return await hit(*args, **kwargs)

        quota.limiter.hit = counted

        async def one(tenant: str):
            try:
                await quota.charge(tenant, 1, 100)
            except HttpError as e:
                return e
            return None

        within = await asyncio.gather(*(one(tenant_id) for _ in range(15)))
        hits_within, hits = hits, 0
        past = await asyncio.gather(*(one(tenant_id) for _ in range(10)), *(one(tenant_id + "-b") for _ in range(3)))
        await client.aclose()
        return within, hits_within, past, hits

    within, hits_within, past, hits_past = asyncio.run(run())
    assert within == [None] * 15 and hits_within == 2          # records and bytes, once each for all 15
    assert past[:5] == [None] * 5 and past[10:] == [None] * 3   # the 5 records left of 20, and the other tenant
    assert all(e.status == 429 and e.code == "quota_exceeded" and "records" in e.message for e in past[5:10])
    assert hits_past == (1 + 10 + 1) + 2     # A: its sum refused, each record alone, the 5 bytes together; B: 2

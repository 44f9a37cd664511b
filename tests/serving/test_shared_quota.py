"""Per-tenant quotas shared through the suite's real Redis by several gateways
(clora.serving.quota_store): each `QuotaStore` below is what one gateway instance holds. A
tenant's limit holds in total across them, other tenants are unaffected, a lease its gateway
no longer renews (killed) frees its slot, and a Redis outage leaves serving up, each gateway
counting on its own. The same with two in-process gateways (tests/serving/gateway_harness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

import httpx
import pytest

from clora.serving.metrics import GatewayMetrics
from clora.serving.quota import TenantQuota
from clora.serving.quota_store import QuotaStore
from clora.serving.record_quota import RecordQuota
from clora.serving.tenant_slots import LocalSlots, Occupancy, Slot, SlotLimits, slots_key
from clora.web import HttpError
from tests.serving.gateway_harness import STREAM, Harness, default_vllm, sse

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]
FAST = {"rate_per_s": 1000.0, "burst": 1000}
"""A rate no test here reaches."""


def gateway_store(stack, *, lease_s: float = 30.0, url: str | None = None, retry_s: float = 5.0,
                  metrics: GatewayMetrics | None = None) -> QuotaStore:
    return QuotaStore.connect(url or stack.redis_url, lease_s=lease_s, timeout_s=1.0, retry_s=retry_s,
                              metrics=metrics)


def tenants(n: int) -> list[str]:
    return [f"t-{uuid.uuid4().hex[:10]}" for _ in range(n)]


async def refused(quota: TenantQuota, tenant: str, match: str, **kw) -> HttpError:
    with pytest.raises(HttpError, match=match) as e:
        await quota.acquire(tenant, **kw)
    assert e.value.status == 429 and int(e.value.headers["retry-after"]) >= 1
    return e.value


def test_two_gateways_share_a_tenants_requests_in_flight_and_other_tenants_are_unaffected(stack):
    acme, globex = tenants(2)

    async def go():
        a, b = (TenantQuota(concurrency=3, store=gateway_store(stack), **FAST) for _ in range(2))
        held = [await a.acquire(acme), await a.acquire(acme), await b.acquire(acme)]
        for gw in (a, b):
            await refused(gw, acme, "has 3 requests in flight")
        await b.acquire(globex)
        await a.release(held[0])
        await b.acquire(acme)                                   # freed by the other gateway
        await refused(a, acme, "has 3 requests in flight")
        assert (a.in_flight(acme), b.in_flight(acme)) == (1, 2)   # each gateway's own holds
        assert await a.store.slots.occupancy(acme) == Occupancy(3, 3, ())
        await a.store.close()
        await b.store.close()

    asyncio.run(go())


def test_sequences_and_pinned_versions_are_shared_too(stack):
    acme, = tenants(1)

    async def go():
        a, b = (TenantQuota(concurrency=10, sequences=16, pinned_versions=2, store=gateway_store(stack), **FAST)
                for _ in range(2))
        await a.acquire(acme, 8, pinned=1)
        await b.acquire(acme, 4, pinned=3)
        e = await refused(a, acme, "versions", sequences=1, pinned=5)
        assert "(v1, v3); at most 2" in e.message
        await refused(b, acme, "12 sequences in flight; 5 more", sequences=5)
        await b.acquire(acme, 4, pinned=1)                      # a version already held, the last 4 sequences
        await refused(a, acme, "sequences", sequences=1)
        await a.store.close()
        await b.store.close()

    asyncio.run(go())


ADMISSION = [  # (sequences, pinned version, the limit it passes) in order, SlotLimits(4, 10, 2)
    (4, None, None), (4, 1, None), (3, 2, "sequences"), (1, 3, None), (1, 5, "versions"), (1, 1, None),
    (1, None, "requests"),
]


@pytest.mark.parametrize("where", ["local", "redis"])
def test_redis_and_this_process_admit_by_the_same_rule(stack, where):
    """The Lua script and `refusal` (the local count) say the same, in the same order."""
    acme, = tenants(1)
    limits = SlotLimits(requests=4, sequences=10, pinned_versions=2)

    async def go():
        local, redis_slots = LocalSlots(), gateway_store(stack).slots
        seen = []
        for i, (sequences, pinned, _) in enumerate(ADMISSION):
            slot = Slot(acme, str(i), sequences, pinned)
            taken = local.acquire(slot, limits) if where == "local" else await redis_slots.acquire(slot, limits)
            seen.append((sequences, pinned, taken.refused))
        before = local.occupancy(acme) if where == "local" else await redis_slots.occupancy(acme)
        await redis_slots.close()
        await redis_slots.client.aclose()
        return seen, before

    seen, held = asyncio.run(go())
    assert seen == ADMISSION
    assert held == Occupancy(requests=4, sequences=10, pinned=(1, 3))


def test_two_gateways_share_a_tenants_rate_and_recorded_bytes(stack):
    acme, globex = tenants(2)

    async def go():
        stores = [gateway_store(stack) for _ in range(2)]
        a, b = (TenantQuota(concurrency=100, rate_per_s=3.0, burst=3, store=s) for s in stores)
        for gw in (a, a, b):
            await gw.release(await gw.acquire(acme))
        for gw in (a, b):
            await refused(gw, acme, "exceeded 3 requests/s")
        await b.release(await b.acquire(globex))
        ra, rb = (RecordQuota(s, bytes_per_s=1000, window_s=2) for s in stores)   # 2000 bytes per 2 s
        await ra.charge(acme, 1500)
        with pytest.raises(HttpError, match="recorded bytes") as e:
            await rb.charge(acme, 600)
        assert e.value.status == 429
        await rb.charge(globex, 1500)
        for s in stores:
            await s.close()

    asyncio.run(go())


def test_a_lease_its_gateway_no_longer_renews_expires_and_frees_its_slot(stack, redis_client):
    """A gateway killed with a request in flight never releases it; its lease lapses."""
    acme, = tenants(1)

    async def go():
        a, b = (TenantQuota(concurrency=1, store=gateway_store(stack, lease_s=0.5), **FAST) for _ in range(2))
        await a.acquire(acme)
        assert 0 < redis_client.pttl(slots_key(acme)) <= 500
        await a.store.slots.close()                             # "killed": no more renewals, no release
        await refused(b, acme, "has 1 requests in flight")
        await asyncio.sleep(0.8)
        await b.acquire(acme)
        await a.store.close()
        await b.store.close()

    asyncio.run(go())


def test_a_lease_is_renewed_while_its_request_runs_and_the_key_goes_with_the_last(stack, redis_client):
    acme, = tenants(1)

    async def go():
        # a lease of 2 s, renewed every 0.67 s: a loaded CI machine stalled this process past a 0.5 s
        # lease (1 in 3 runs while other work ran), and the slot expired between renewals
        a, b = (TenantQuota(concurrency=1, store=gateway_store(stack, lease_s=2.0), **FAST) for _ in range(2))
        slot = await a.acquire(acme)
        await asyncio.sleep(6.2)                                # three lease times: renewed all along
        await refused(b, acme, "has 1 requests in flight")
        await a.release(slot)
        assert redis_client.exists(slots_key(acme)) == 0
        await b.release(await b.acquire(acme))
        await a.store.close()
        await b.store.close()

    asyncio.run(go())


class RedisProxy:
    """A TCP proxy in front of Redis that can be cut (every connection reset, its port
    refusing) and restored on the same port: a Redis outage as the gateway sees it."""

    def __init__(self, port: int):
        self.target, self.port, self.server = port, 0, None
        self._conns: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        self.server.close()
        for w in self._conns:
            w.transport.abort()
        self._conns.clear()
        await asyncio.sleep(0.05)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._conns += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_while_redis_is_down_each_gateway_serves_and_enforces_the_limit_on_its_own(stack, caplog):
    """Fail local: served, not refused (a 503 would stop every tenant) and not unlimited (one
    tenant could take the engine); a warning when it starts and ends, and a metric per check."""
    acme, globex = tenants(2)
    metrics = GatewayMetrics()

    def fallbacks(limit: str) -> float:
        return metrics.registry.get_sample_value("clora_gateway_quota_fallbacks_total", {"limit": limit}) or 0.0

    async def go():
        proxy = RedisProxy(int(stack.redis_url.rsplit(":", 1)[1].split("/")[0]))
        await proxy.start()
        store = gateway_store(stack, url=proxy.url, lease_s=1.0, retry_s=0.5, metrics=metrics)
        q, record = TenantQuota(concurrency=2, store=store, **FAST), RecordQuota(store, bytes_per_s=1000, window_s=1)
        before = await q.acquire(acme)
        assert store.slots.granted(before) and fallbacks("slots") == 0
        await proxy.cut()
        during = await q.acquire(acme)                          # served, counted here
        assert not store.slots.granted(during)
        await refused(q, acme, "has 2 requests in flight")      # the limit still holds, per gateway
        await q.release(await q.acquire(globex))
        await record.charge(acme, 900)
        with pytest.raises(HttpError, match="recorded bytes"):
            await record.charge(acme, 200)
        await q.release(before)                                 # never raises; its lease lapses in Redis
        await q.release(during)
        assert fallbacks("slots") >= 3 and fallbacks("requests_per_s") >= 2 and fallbacks("recorded_bytes") == 2
        await proxy.start()                                     # Redis is back: after retry_s, shared again
        await asyncio.sleep(0.6)
        after = await q.acquire(acme)
        assert store.slots.granted(after)
        await q.release(after)
        await store.close()
        proxy.server.close()

    with caplog.at_level(logging.WARNING, logger="clora.serving.quota_store"):
        asyncio.run(go())
    said = [r.getMessage() for r in caplog.records if r.name == "clora.serving.quota_store"]
    assert len(said) == 2 and "failed" in said[0] and "answers again" in said[1], said


# --- two in-process gateways on the same Redis ---------------------------------------------------

@pytest.fixture
def gateways(tmp_path, stack):
    made: list[Harness] = []

    def make(n: int, vllm=default_vllm, **settings) -> list[Harness]:
        for i in range(n):
            made.append(Harness(tmp_path / f"gw{i}", vllm, quota_store=gateway_store(stack), **settings))
        return made

    yield make
    for h in made:
        h.close()


def test_two_gateways_on_one_redis_hold_a_tenants_requests_in_flight_in_total(gateways):
    acme, globex = tenants(2)
    gate = asyncio.Event()

    def vllm(request: httpx.Request):
        if request.url.path.endswith("completions") and json.loads(request.read()).get("stream"):
            async def body():
                await gate.wait()
                yield sse(STREAM)
            return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})
        return default_vllm(request)

    a, b = gateways(2, vllm, tenant_concurrency=2)

    async def go():
        held = [asyncio.create_task(gw.call({"model": acme, "messages": MSGS, "stream": True}, tenant=acme))
                for gw in (a, b)]
        await asyncio.sleep(0.3)
        over = [await gw.call({"model": acme, "messages": MSGS}, tenant=acme) for gw in (a, b)]
        other = await b.call({"model": globex, "messages": MSGS}, tenant=globex)
        gate.set()
        done = await asyncio.gather(*held)
        again = await a.call({"model": acme, "messages": MSGS}, tenant=acme)
        left = await a.gateway.quota_store.slots.occupancy(acme)
        for gw in (a, b):
            await gw.gateway.quota_store.close()
        return over, other, done, again, left

    over, other, done, again, left = asyncio.run(go())
    assert [r.status for r in over] == [429, 429], [r.body for r in over]
    assert all("has 2 requests in flight" in r.json()["error"]["message"] for r in over)
    assert over[0].headers["retry-after"] == "1"
    assert other.status == 200 and [r.status for r in done] == [200, 200] and again.status == 200
    assert left == Occupancy(0, 0, ())
    assert a.held(acme) == b.held(acme) == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


def test_two_gateways_on_one_redis_share_a_tenants_rate(gateways):
    acme, globex = tenants(2)
    a, b = gateways(2, tenant_rate_per_s=2.0, tenant_burst=2)

    async def go():
        ok = [await gw.call({"model": acme, "messages": MSGS}, tenant=acme) for gw in (a, b)]
        over = [await gw.call({"model": acme, "messages": MSGS}, tenant=acme) for gw in (a, b)]
        other = await a.call({"model": globex, "messages": MSGS}, tenant=globex)
        for gw in (a, b):
            await gw.gateway.quota_store.close()
        return ok, over, other

    ok, over, other = asyncio.run(go())
    assert [r.status for r in ok] == [200, 200] and other.status == 200
    assert [r.status for r in over] == [429, 429]
    assert "exceeded 2 requests/s" in over[1].json()["error"]["message"] and int(over[1].headers["retry-after"]) >= 1

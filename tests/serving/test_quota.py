"""Per-tenant admission (clora.serving.quota) in one process's memory: requests, sequences and
pinned versions in flight, and requests per second, each per tenant. The same limits shared
through Redis by several gateways: tests/serving/test_shared_quota.py."""

from __future__ import annotations

import asyncio

import pytest

from clora.serving.quota import TenantQuota
from clora.serving.tenant_slots import LocalSlots, Occupancy, Slot, SlotLimits, refusal
from clora.web import HttpError


def test_quota_concurrency_and_rate():
    q = TenantQuota(concurrency=2, rate_per_s=3.0, burst=3)

    async def go():
        a1, a2 = await q.acquire("a"), await q.acquire("a")
        with pytest.raises(HttpError) as e:
            await q.acquire("a")
        assert e.value.status == 429 and "in flight" in e.value.message
        await q.acquire("b")  # other tenants are unaffected
        await q.release(a1)
        await q.release(a2)
        await q.release(await q.acquire("a"))  # 3 requests this second
        with pytest.raises(HttpError, match="requests/s") as e:
            await q.acquire("a")
        assert e.value.status == 429 and e.value.headers["retry-after"] == "1"
        assert q.in_flight("a") == 0  # a request refused for its rate holds nothing
        await asyncio.sleep(1.1)
        await q.acquire("a")

    asyncio.run(go())


def test_quota_counts_each_requests_sequences_against_the_tenants_share():
    q = TenantQuota(concurrency=10, rate_per_s=100.0, burst=100, sequences=16)

    async def go():
        first = await q.acquire("a", 8)
        await q.acquire("a", 8)
        with pytest.raises(HttpError, match="sequences") as e:
            await q.acquire("a", 1)
        assert e.value.status == 429
        await q.acquire("b", 16)  # other tenants are unaffected
        await q.release(first)
        await q.acquire("a", 8)
        assert q.sequences_in_flight("a") == 16 and q.in_flight("a") == 2

    asyncio.run(go())


def test_a_tenant_may_have_requests_in_flight_to_at_most_its_pinned_versions():
    q = TenantQuota(concurrency=10, rate_per_s=100.0, burst=100, pinned_versions=2)

    async def go():
        v1 = await q.acquire("a", pinned=1)
        v3 = await q.acquire("a", pinned=3)
        await q.acquire("a", pinned=1)       # a version already held
        await q.acquire("a")                 # the live one
        with pytest.raises(HttpError) as e:
            await q.acquire("a", pinned=4)
        assert e.value.status == 429 and "2 versions other than its live one (v1, v3); at most 2" in e.value.message
        await q.acquire("b", pinned=4)       # other tenants are unaffected
        await q.release(v3)
        await q.acquire("a", pinned=4)
        await q.release(v1)
        assert q.pinned_in_flight("a") == 2 and q.in_flight("a") == 3

    asyncio.run(go())


@pytest.mark.parametrize("rate_per_s, burst, amount, window_s", [
    (50.0, 100, 100, 2),     # the defaults: 100 requests per 2 s
    (1.0, 3, 3, 3),
    (1000.0, 10, 1000, 1),   # a window is whole seconds: the burst is at least one second's worth
    (0.3, 1, 1, 4),          # never above the rate: 1 per 4 s, not per 3.33 s
])
def test_the_rate_is_a_sliding_window_of_the_burst(rate_per_s, burst, amount, window_s):
    item = TenantQuota(concurrency=1, rate_per_s=rate_per_s, burst=burst).rate_item
    assert (item.amount, item.get_expiry()) == (amount, window_s)


# --- the admission rule (the same rule runs in Redis: test_shared_quota.py) ---------------------

def test_the_first_limit_passed_is_the_one_named():
    limits = SlotLimits(requests=2, sequences=4, pinned_versions=1)
    full = Occupancy(requests=2, sequences=4, pinned=(3,))
    assert refusal(full, Slot("a", "x", 1, 5), limits) == "requests"
    assert refusal(Occupancy(1, 4, (3,)), Slot("a", "x", 1, 5), limits) == "sequences"
    assert refusal(Occupancy(1, 3, (3,)), Slot("a", "x", 1, 5), limits) == "versions"
    assert refusal(Occupancy(1, 3, (3,)), Slot("a", "x", 1, 3), limits) is None
    assert refusal(Occupancy(1, 3, (3,)), Slot("a", "x", 1, None), limits) is None


def test_local_slots_count_what_is_held_per_tenant():
    slots = LocalSlots()
    held = [Slot("a", "1", 1, None), Slot("a", "2", 8, 3), Slot("a", "3", 2, 3), Slot("b", "4", 4, 1)]
    for s in held:
        assert slots.acquire(s, None).refused is None
    assert slots.occupancy("a") == Occupancy(requests=3, sequences=11, pinned=(3,))
    slots.release(held[1])
    slots.release(held[1])  # twice: no effect
    assert slots.occupancy("a") == Occupancy(requests=2, sequences=3, pinned=(3,))
    assert slots.occupancy("c") == Occupancy(0, 0, ())

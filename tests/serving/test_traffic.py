"""The gateway's per-minute traffic counts: bucketing and status classes (a fake registry),
a Redis outage (counts kept for the next flush), and the round trip through real Redis."""

from __future__ import annotations

import asyncio

import redis

from clora.serving.traffic import CLIENT_LEFT, TrafficRollup


class FakeRegistry:
    def __init__(self):
        self.added: list[dict] = []
        self.down = False

    def add_traffic(self, counts):
        if self.down:
            raise redis.ConnectionError("redis is down")
        self.added.append(counts)


def test_counts_per_tenant_and_minute_by_status_class():
    now = [600.0]  # minute 10
    reg = FakeRegistry()
    roll = TrafficRollup(reg, clock=lambda: now[0])
    roll.answered("acme", 200, 0.5)
    roll.answered("acme", 200, 1.5)
    roll.answered("acme", 429, 0.001)
    roll.answered("acme", 503, 2.0)
    roll.answered("acme", CLIENT_LEFT, 3.0)
    roll.served("acme", 10, 4)
    roll.answered("other", 400, 0.01)
    now[0] = 660.0  # minute 11
    roll.answered("acme", 200, 1.0)
    asyncio.run(roll.flush())
    (added,) = reg.added
    assert added[("acme", 10)] == {"requests": 5, "ok": 2, "latency_s": 2.0, "refused": 1, "errors": 1,
                                   "prompt_tokens": 10, "completion_tokens": 4}
    assert added[("other", 10)] == {"requests": 1, "refused": 1}
    assert added[("acme", 11)] == {"requests": 1, "ok": 1, "latency_s": 1.0}
    asyncio.run(roll.flush())
    assert len(reg.added) == 1  # nothing new: nothing sent


def test_a_redis_outage_keeps_the_counts_for_the_next_flush():
    reg = FakeRegistry()
    roll = TrafficRollup(reg, clock=lambda: 600.0)
    roll.answered("acme", 200, 1.0)
    reg.down = True
    asyncio.run(roll.flush())
    roll.answered("acme", 200, 1.0)
    reg.down = False
    asyncio.run(roll.flush())
    assert reg.added == [{("acme", 10): {"requests": 2, "ok": 2, "latency_s": 2.0}}]


def test_round_trip_through_redis(registry, tenant_id):
    registry.add_traffic({(tenant_id, 100): {"requests": 2, "ok": 2, "latency_s": 1.5}})
    registry.add_traffic({(tenant_id, 100): {"requests": 1, "errors": 1}, (tenant_id, 102): {"requests": 4}})
    minutes = registry.traffic(tenant_id, minutes=4, now=102 * 60 + 30)
    assert [m["minute"] for m in minutes] == [99 * 60, 100 * 60, 101 * 60, 102 * 60]
    assert minutes[0] == {"minute": 99 * 60} and minutes[2] == {"minute": 101 * 60}  # no traffic
    assert minutes[1] == {"minute": 6000, "requests": 3, "ok": 2, "latency_s": 1.5, "errors": 1}
    assert minutes[3] == {"minute": 102 * 60, "requests": 4}
    assert 0 < registry.r.ttl(f"clora:tenant:{tenant_id}:traffic:100") <= 2 * 86400
    other = tenant_id + "-b"
    registry.add_traffic({(other, 101): {"requests": 5, "errors": 2}})
    totals = registry.traffic_totals([tenant_id, other, tenant_id + "-none"], minutes=2, now=102 * 60)
    assert totals == {tenant_id: {"requests": 4.0}, other: {"requests": 5.0, "errors": 2.0}, tenant_id + "-none": {}}

"""Where the gateway counts each tenant's limits, and what happens when that place fails.

Shared (`QuotaStore.connect(redis_url)`, the registry's Redis; `GatewaySettings.shared_quotas`):
every gateway instance counts in the same place, so a limit is the tenant's total however many
gateways serve it.
- Rate limits (`hit`): the `limits` library's sliding-window counter in Redis, keys
  `clora:gateway:quota:{<namespace>/<tenant>/<amount>/<window>/second}` (and `.../-1`, the
  previous window; one Redis Cluster slot per limit and tenant, by the braces).
- Slots (requests, sequences and pinned versions in flight): `tenant_slots.RedisSlots`, keys
  `clora:gateway:slots:{<tenant>}`, leases that expire unless their gateway renews them.

Local (`QuotaStore.local()`): this process's memory, for a single gateway (tests, and a
deployment that turns `shared_quotas` off). Each gateway then enforces every limit on its own.

What stays per gateway by nature: the engine leases and adapter pins on its replicas (its own
`EngineManager`'s view, `adapter_wait_s`), and what `Gateway.holds` reports (this gateway's
requests only; `RedisSlots.occupancy` is the total).

**When Redis fails** (refused, timed out after `quota_store_timeout_s`, erroring), the checks
fall back to local counting for `quota_store_retry_s`, then try Redis again: requests are still
served, each gateway enforcing every limit on its own (a tenant may get up to N times its limit
through N gateways while Redis is down, never more), with a warning in the log when the outage
starts and ends and `clora_gateway_quota_fallbacks_total{limit}` counting each check made
locally (`limit`: `slots`, `requests_per_s`, `recorded_bytes`). Refusing every request instead
(fail closed) would take serving down for every tenant to stop one; not limiting at all (fail
open) would let one tenant take the whole engine. Leases taken in Redis before the outage
expire there by themselves (`quota_lease_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis
import redis.asyncio
from limits import RateLimitItem
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter as SharedLimiter
from limits.errors import StorageError
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter as LocalLimiter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from clora.serving.tenant_slots import LocalSlots, RedisSlots
from clora.settings import ASYNC_REDIS_CONNECTIONS

log = logging.getLogger(__name__)

QUOTA_PREFIX = "clora:gateway:quota"
"""Where `limits` keeps the gateway's rate-limit counters in Redis."""

STORE_ERRORS = (StorageError, redis.RedisError, OSError, asyncio.TimeoutError)
"""What a failing Redis raises (refused, reset, timed out, erroring)."""


class QuotaStore:
    """Rate-limit counters and slots, shared through Redis (`client`) or local (None)."""

    def __init__(self, client: redis.asyncio.Redis | None = None, *, lease_s: float = 30.0, retry_s: float = 5.0,
                 metrics=None, clock=time.monotonic):
        """`metrics`: a `GatewayMetrics` whose `quota_fallbacks` counts local checks."""
        self.client, self.retry_s, self.metrics, self.clock = client, retry_s, metrics, clock
        self.local_slots = LocalSlots()
        """This process's slots: what `Gateway.holds` reports, and the fallback's count."""
        self.slots = RedisSlots(client, lease_s) if client is not None else None
        """Every gateway's slots (None: local only)."""
        self._local_limiter = LocalLimiter(MemoryStorage())
        self._shared_limiter = SharedLimiter(RedisStorage(
            "async+redis://", implementation="redispy", key_prefix=QUOTA_PREFIX,
            connection_pool=client.connection_pool)) if client is not None else None
        self._down_until: float | None = None
        """While Redis is counted as down: when to try it again."""

    @classmethod
    def local(cls) -> "QuotaStore":
        return cls(None)

    @classmethod
    def connect(cls, redis_url: str, *, lease_s: float, timeout_s: float, retry_s: float,
                metrics=None) -> "QuotaStore":
        """Shared through the Redis at `redis_url`. A call waits at most `timeout_s` (one retry,
        for a pooled connection that a Redis restart closed) before the check falls back."""
        pool = redis.asyncio.BlockingConnectionPool.from_url(   # a burst waits for a connection, not fails
            redis_url, max_connections=ASYNC_REDIS_CONNECTIONS, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
        client = redis.asyncio.Redis(connection_pool=pool)
        return cls(client, lease_s=lease_s, retry_s=retry_s, metrics=metrics)

    @property
    def shared(self) -> bool:
        return self.client is not None

    def reachable(self) -> bool:
        """Shared, and Redis not counted as down (or due for another try)."""
        return self.client is not None and (self._down_until is None or self.clock() >= self._down_until)

    def failed(self, limit: str, e: BaseException) -> None:
        """Redis failed a `limit` check: count locally for `retry_s` (the first failure of an
        outage is logged)."""
        if self._down_until is None:
            log.warning("the quota store (Redis) failed (%r): every gateway now counts each tenant's limits on its "
                        "own, until Redis answers again (tried every %g s)", e, self.retry_s)
        self._down_until = self.clock() + self.retry_s

    def answered(self) -> None:
        """Redis answered a check: the outage, if any, is over."""
        if self._down_until is not None:
            log.warning("the quota store (Redis) answers again: limits are shared across gateways again")
            self._down_until = None

    def fell_back(self, limit: str) -> None:
        """A `limit` check of a shared store was made locally."""
        if self.metrics is not None:
            self.metrics.quota_fallbacks.labels(limit).inc()

    async def hit(self, limit: str, item: RateLimitItem, tenant: str, cost: int = 1) -> float | None:
        """Count `cost` against `tenant`'s `item` (`limit` names it in logs and metrics): None
        when it fits, else the seconds until it may."""
        if self.reachable():
            try:
                fits = await self._shared_limiter.hit(item, tenant, cost=cost)
                stats = None if fits else await self._shared_limiter.get_window_stats(item, tenant)
            except STORE_ERRORS as e:
                self.failed(limit, e)
            else:
                self.answered()
                return None if stats is None else max(0.0, stats.reset_time - time.time())
        if self.shared:
            self.fell_back(limit)
        if self._local_limiter.hit(item, tenant, cost=cost):
            return None
        return max(0.0, self._local_limiter.get_window_stats(item, tenant).reset_time - time.time())

    async def close(self) -> None:
        if self.slots is not None:
            await self.slots.close()
        if self.client is not None:
            await self.client.aclose()

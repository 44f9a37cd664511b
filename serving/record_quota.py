"""Per-tenant byte quota on what the gateway records: the `messages` and `tools` of each
request end up in its interaction event (Kafka, the spool, the learner's data), so one tenant
sending large requests fast could fill the broker and the disk for everyone.

`RecordQuota.charge(tenant, nbytes)` admits a request's recorded bytes or raises a 429 with a
`retry-after`. The budget is `bytes_per_s` x `window_s` bytes per sliding window of `window_s`
seconds (the `limits` library's sliding-window counter), kept in Redis so that every gateway
process shares it (`memory://` for one process and tests).
"""

from __future__ import annotations

import asyncio
import time

import redis
from limits import RateLimitItemPerSecond
from limits.errors import StorageError
from limits.storage import storage_from_string
from limits.strategies import SlidingWindowCounterRateLimiter

from clora.serving import errors

NAMESPACE = "clora-recorded-bytes"


class RecordQuota:
    def __init__(self, storage_uri: str, bytes_per_s: int, window_s: int):
        self.bytes_per_s, self.window_s = bytes_per_s, window_s
        self._item = RateLimitItemPerSecond(bytes_per_s * window_s, window_s, namespace=NAMESPACE)
        self._limiter = SlidingWindowCounterRateLimiter(storage_from_string(storage_uri))

    async def charge(self, tenant: str, nbytes: int) -> None:
        """Admit `nbytes` recorded bytes of `tenant` or raise a 429 `HttpError` (a 503 when the
        quota's store cannot be reached)."""
        if nbytes <= 0:
            return
        try:
            if await asyncio.to_thread(self._limiter.hit, self._item, tenant, cost=nbytes):
                return
            stats = await asyncio.to_thread(self._limiter.get_window_stats, self._item, tenant)
        except (StorageError, redis.RedisError) as e:
            raise errors.unavailable(f"the recorded-bytes quota store is unreachable: {e}") from e
        raise errors.rate_limited(f"tenant {tenant} sent more than {self.bytes_per_s} recorded bytes/s (messages and "
                                  f"tools, over {self.window_s} s); this request records {nbytes} bytes",
                                  max(1.0, stats.reset_time - time.time()))

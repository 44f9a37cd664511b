"""Per-tenant byte quota on what the gateway records: the `messages` and `tools` of each
request end up in its interaction event (Kafka, the spool, the learner's data), so one tenant
sending large requests fast could fill the broker and the disk for everyone.

`RecordQuota.charge(tenant, nbytes)` admits a request's recorded bytes or raises a 429 with a
`retry-after`. The budget is `bytes_per_s` x `window_s` bytes per sliding window of `window_s`
seconds (the `limits` library's sliding-window counter), counted by the `QuotaStore`: in Redis,
shared by every gateway process (this process only when Redis fails, or in local mode).
"""

from __future__ import annotations

from limits import RateLimitItemPerSecond

from clora.serving import errors
from clora.serving.quota_store import QuotaStore

NAMESPACE = "recorded-bytes"


class RecordQuota:
    def __init__(self, store: QuotaStore, bytes_per_s: int, window_s: int):
        self.store, self.bytes_per_s, self.window_s = store, bytes_per_s, window_s
        self._item = RateLimitItemPerSecond(bytes_per_s * window_s, window_s, namespace=NAMESPACE)

    async def charge(self, tenant: str, nbytes: int) -> None:
        """Admit `nbytes` recorded bytes of `tenant` or raise a 429 `HttpError`."""
        if nbytes <= 0:
            return
        retry_after = await self.store.hit("recorded_bytes", self._item, tenant, cost=nbytes)
        if retry_after is not None:
            raise errors.rate_limited(f"tenant {tenant} sent more than {self.bytes_per_s} recorded bytes/s (messages "
                                      f"and tools, over {self.window_s} s); this request records {nbytes} bytes",
                                      max(1.0, retry_after))

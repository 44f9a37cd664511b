"""Per-tenant admission: requests in flight, sequences in flight (a request with `n` = 8 holds
8 of the engine's sequence slots), versions other than the live one in flight (each pins an
adapter slot on the replicas), and requests per second. Refusals answer 429 with a
`retry-after`.

Each is the tenant's total across every gateway instance when the `QuotaStore` is shared
(Redis; `quota_store` says what happens when Redis fails): the in-flight limits as one lease
per request (`tenant_slots`), requests per second as the `limits` library's sliding-window
counter of `burst` requests per `ceil(burst / rate_per_s)` s. Example: 50 requests/s with a
burst of 100 is 100 requests per 2 s window. A window is whole seconds, so a burst below one
second's worth of requests is raised to it (`rate_per_s` 1000, `burst` 10: 1000 per 1 s).

A request's slot is taken before its rate is counted: a request refused for its slots does not
use up the tenant's rate.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field

from limits import RateLimitItemPerSecond

from clora.serving.errors import rate_limited
from clora.serving.quota_store import STORE_ERRORS, QuotaStore
from clora.serving.tenant_slots import Slot, SlotLimits, Taken
from clora.web import HttpError

log = logging.getLogger(__name__)


@dataclass
class TenantQuota:
    concurrency: int
    """Requests in flight per tenant."""
    rate_per_s: float
    burst: int
    sequences: int | None = None
    """Sequences in flight per tenant (None: only `concurrency` counts)."""
    pinned_versions: int | None = None
    """Distinct versions other than the live one in flight per tenant (None: uncounted)."""
    store: QuotaStore = field(default_factory=QuotaStore.local)

    def __post_init__(self) -> None:
        self.slot_limits = SlotLimits(self.concurrency, self.sequences, self.pinned_versions)
        window = max(1, math.ceil(self.burst / self.rate_per_s))
        self.rate_item = RateLimitItemPerSecond(max(self.burst, math.floor(self.rate_per_s * window)), window,
                                                namespace="requests")

    async def acquire(self, tenant: str, sequences: int = 1, pinned: int | None = None) -> Slot:
        """Admit one request of `sequences` sequences (to the version `pinned` when that is not
        the tenant's live one) or raise a 429 `HttpError`. Pair with `release(slot)`."""
        slot = Slot(tenant, uuid.uuid4().hex, sequences, pinned)
        taken = await self._take(slot)
        if taken.refused is not None:
            raise self._refused(slot, taken)
        try:
            retry_after = await self.store.hit("requests_per_s", self.rate_item, tenant)
        except BaseException:
            await self.release(slot)
            raise
        if retry_after is not None:
            await self.release(slot)
            raise rate_limited(f"tenant {tenant} exceeded {self.rate_per_s:g} requests/s (burst {self.burst})",
                               retry_after)
        return slot

    async def release(self, slot: Slot) -> None:
        """Give `slot` back. Never raises: a lease Redis did not take back expires there."""
        store = self.store
        store.local_slots.release(slot)
        if store.slots is None or not store.slots.granted(slot):
            return
        if not store.reachable():
            store.slots.forget(slot)
            return
        try:
            await store.slots.release(slot)
        except STORE_ERRORS as e:
            store.failed("slots", e)
            log.warning("tenant %s's quota slot could not be given back to Redis (%r); it expires there within %g s",
                        slot.tenant, e, store.slots.lease_s)

    def in_flight(self, tenant: str) -> int:
        """Requests of `tenant` in flight through this gateway."""
        return self.store.local_slots.occupancy(tenant).requests

    def sequences_in_flight(self, tenant: str) -> int:
        return self.store.local_slots.occupancy(tenant).sequences

    def pinned_in_flight(self, tenant: str) -> int:
        """Requests of `tenant` in flight through this gateway to versions other than its live one."""
        return sum(1 for s in self.store.local_slots.held(tenant) if s.pinned is not None)

    async def _take(self, slot: Slot) -> Taken:
        """Take `slot` in Redis (and note it here), or here alone: in local mode, and while
        Redis fails."""
        store = self.store
        if store.reachable():
            try:
                taken = await store.slots.acquire(slot, self.slot_limits)
            except STORE_ERRORS as e:
                store.failed("slots", e)
            else:
                store.answered()
                if taken.refused is None:
                    store.local_slots.acquire(slot, None)
                return taken
        if store.shared:
            store.fell_back("slots")
        return store.local_slots.acquire(slot, self.slot_limits)

    def _refused(self, slot: Slot, taken: Taken) -> HttpError:
        before, tenant = taken.before, slot.tenant
        if taken.refused == "requests":
            return rate_limited(f"tenant {tenant} has {before.requests} requests in flight "
                                f"(limit {self.concurrency})", 1.0)
        if taken.refused == "sequences":
            return rate_limited(f"tenant {tenant} has {before.sequences} sequences in flight; {slot.sequences} more "
                                f"would pass its share of the engine ({self.sequences} sequences)", 1.0)
        return rate_limited(f"tenant {tenant} already has requests in flight to {len(before.pinned)} versions "
                            f"other than its live one ({', '.join(f'v{v}' for v in before.pinned)}); at most "
                            f"{self.pinned_versions} at once", 1.0)

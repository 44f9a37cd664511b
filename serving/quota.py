"""Per-tenant admission: concurrency limits (requests and sequences in flight: a request
with `n` = 8 holds 8 of the engine's sequence slots) and a token-bucket rate limit (requests
per second with a burst). Refusals answer 429 with a `retry-after`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from clora.serving.errors import rate_limited


@dataclass
class _TenantState:
    tokens: float
    stamp: float
    in_flight: int = 0
    sequences: int = 0


@dataclass
class TenantQuota:
    concurrency: int
    rate_per_s: float
    burst: int
    sequences: int | None = None
    """Sequences in flight per tenant (None: only `concurrency` counts)."""
    clock: callable = time.monotonic
    _tenants: dict[str, _TenantState] = field(default_factory=dict)

    def acquire(self, tenant: str, sequences: int = 1) -> None:
        """Admit one request of `sequences` sequences or raise a 429 `HttpError`. Pair with
        `release(tenant, sequences)`."""
        now = self.clock()
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _TenantState(tokens=float(self.burst), stamp=now)
        st.tokens = min(float(self.burst), st.tokens + (now - st.stamp) * self.rate_per_s)
        st.stamp = now
        if st.in_flight >= self.concurrency:
            raise rate_limited(f"tenant {tenant} has {st.in_flight} requests in flight "
                               f"(limit {self.concurrency})", 1.0)
        if self.sequences is not None and st.sequences + sequences > self.sequences:
            raise rate_limited(f"tenant {tenant} has {st.sequences} sequences in flight; {sequences} more would pass "
                               f"its share of the engine ({self.sequences} sequences)", 1.0)
        if st.tokens < 1.0:
            raise rate_limited(f"tenant {tenant} exceeded {self.rate_per_s:g} requests/s "
                               f"(burst {self.burst})", (1.0 - st.tokens) / self.rate_per_s)
        st.tokens -= 1.0
        st.in_flight += 1
        st.sequences += sequences

    def release(self, tenant: str, sequences: int = 1) -> None:
        st = self._tenants.get(tenant)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1
            st.sequences = max(0, st.sequences - sequences)

    def in_flight(self, tenant: str) -> int:
        st = self._tenants.get(tenant)
        return st.in_flight if st else 0

    def sequences_in_flight(self, tenant: str) -> int:
        st = self._tenants.get(tenant)
        return st.sequences if st else 0

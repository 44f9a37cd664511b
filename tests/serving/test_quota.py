"""Per-tenant admission (clora.serving.quota): a concurrency limit and a token bucket, per tenant."""

from __future__ import annotations

import pytest

from clora.serving.quota import TenantQuota
from clora.web import HttpError


def test_quota_concurrency_and_rate():
    now = [0.0]
    q = TenantQuota(concurrency=2, rate_per_s=1.0, burst=3, clock=lambda: now[0])
    q.acquire("a")
    q.acquire("a")
    with pytest.raises(HttpError) as e:
        q.acquire("a")
    assert e.value.status == 429 and "in flight" in e.value.message
    q.acquire("b")  # other tenants are unaffected
    q.release("a")
    q.release("a")
    q.acquire("a")
    q.release("a")  # 3 tokens spent
    with pytest.raises(HttpError, match="requests/s"):
        q.acquire("a")
    now[0] = 1.0
    q.acquire("a")


def test_quota_counts_each_requests_sequences_against_the_tenants_share():
    q = TenantQuota(concurrency=10, rate_per_s=100.0, burst=100, sequences=16)
    q.acquire("a", 8)
    q.acquire("a", 8)
    with pytest.raises(HttpError, match="sequences") as e:
        q.acquire("a", 1)
    assert e.value.status == 429
    q.acquire("b", 16)  # other tenants are unaffected
    q.release("a", 8)
    q.acquire("a", 8)
    assert q.sequences_in_flight("a") == 16 and q.in_flight("a") == 2

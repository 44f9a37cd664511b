"""Feedback -> served freshness on the gateway's side (clora.serving.freshness): the first
completion of a version is claimed once among every gateway, only the claimer observes its
lineage's events, the request path touches the registry once per version, and the histogram's
tenant label is bounded."""

from __future__ import annotations

import asyncio

import pytest

from clora.freshness import VersionLineage
from clora.registry import AdapterVersion
from clora.serving.aliases import AdapterRef
from clora.serving.freshness import FreshnessTracker
from clora.serving.metrics import OTHER_TENANTS, GatewayMetrics, TenantLabels


def _observed(metrics: GatewayMetrics) -> dict[str, float]:
    """The freshness histogram's observation count by tenant label."""
    return {s.labels["tenant"]: s.value for fam in metrics.registry.collect()
            if fam.name == "clora_feedback_to_served_seconds" for s in fam.samples if s.name.endswith("_count")}


def test_the_freshness_histogram_names_its_first_tenants_and_groups_the_rest():
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER_TENANTS, "a", OTHER_TENANTS, "b"]
    metrics = GatewayMetrics(freshness_tenants=2)
    for i in range(50):
        metrics.fresh(f"t{i}", [1.0, 2.0])
    assert _observed(metrics) == {"t0": 2, "t1": 2, OTHER_TENANTS: 96}     # 3 series for 50 tenants
    with pytest.raises(ValueError, match=">= 1"):
        TenantLabels(0)


@pytest.mark.integration
def test_of_two_gateways_serving_a_new_version_only_the_first_observes_its_feedback(registry, tenant_id):
    registry.create_tenant(tenant_id)
    registry.record_lineage(tenant_id, 3, VersionLineage(accepted_at={"fb-1": 100.0, "fb-2": 130.0, "fb-3": None}))
    registry.record_adapter_version(tenant_id, AdapterVersion(version=3, path="/a/v3", base_model="b",
                                                              created_at=150.0))
    claims = []
    claim = registry.claim_first_served
    registry.claim_first_served = lambda *a: (claims.append(a), claim(*a))[1]
    gateways = [GatewayMetrics() for _ in range(2)]
    trackers = [FreshnessTracker(registry, m, clock=lambda: 160.0) for m in gateways]
    ref = AdapterRef(tenant_id, 3, "/a/v3")

    async def serve() -> None:
        for _ in range(5):                      # five completions on each gateway, at once
            for t in trackers:
                t.served(ref)
            t.served(None)                      # the base model: nothing to measure
        await asyncio.gather(*(t.drain() for t in trackers))

    asyncio.run(serve())
    assert len(claims) == 2                     # once per gateway process, not per request
    assert sorted(sum(_observed(m).values()) for m in gateways) == [0, 2]
    assert registry.first_served_at(tenant_id, 3) == 160.0
    summary = registry.freshness(tenant_id)[3]
    assert (summary.events, summary.unmeasured, summary.p50_s, summary.published_to_served_s) == (2, 1, 45.0, 10.0)

    asyncio.run(serve())                        # already claimed: nothing more
    assert len(claims) == 2 and sorted(sum(_observed(m).values()) for m in gateways) == [0, 2]


@pytest.mark.integration
def test_a_failed_claim_is_tried_again_by_a_later_completion(registry, tenant_id, caplog):
    registry.create_tenant(tenant_id)
    registry.record_lineage(tenant_id, 1, VersionLineage(accepted_at={"fb-1": 10.0}))
    metrics, calls = GatewayMetrics(), []
    claim = registry.claim_first_served

    def flaky(*a):
        calls.append(a)
        if len(calls) == 1:
            raise ConnectionError("redis restarting")
        return claim(*a)

    registry.claim_first_served = flaky
    tracker = FreshnessTracker(registry, metrics, clock=lambda: 40.0)

    async def serve() -> None:
        tracker.served(AdapterRef(tenant_id, 1, "/a/v1"))
        await tracker.drain()

    asyncio.run(serve())
    assert "redis restarting" in caplog.text and _observed(metrics) == {}
    asyncio.run(serve())
    assert len(calls) == 2 and _observed(metrics) == {tenant_id: 1}
    assert registry.freshness(tenant_id)[1].published_to_served_s is None   # its version record was never written

"""The registry's freshness records in real Redis: a version's lineage, the one claim on its first
served completion, its summary, the tenant's event-weighted median, and that they go with the
version when it is pruned."""

from __future__ import annotations

import threading

import pytest

from clora.freshness import FreshnessSummary, VersionLineage
from clora.registry import AdapterVersion

pytestmark = pytest.mark.integration


def _version(registry, tenant_id: str, version: int, created_at: float, events: dict[str, float | None]) -> None:
    registry.record_lineage(tenant_id, version, VersionLineage(accepted_at=events))
    registry.record_adapter_version(tenant_id, AdapterVersion(version=version, path=f"/a/v{version}", base_model="b",
                                                              created_at=created_at))


def test_a_versions_lineage_round_trips_and_a_version_without_one_has_none(registry, tenant_id):
    registry.create_tenant(tenant_id)
    lineage = VersionLineage(accepted_at={"fb-1": 100.0, "fb-2": None}, over_cap=3)
    registry.record_lineage(tenant_id, 2, lineage)
    assert registry.lineage(tenant_id, 2) == lineage
    assert registry.lineage(tenant_id, 1) == VersionLineage()


def test_of_two_gateways_claiming_a_versions_first_completion_at_once_exactly_one_wins(registry, tenant_id):
    registry.create_tenant(tenant_id)
    for attempt in range(20):                       # a race lost now and then would show here
        version, go, won = attempt + 1, threading.Barrier(2), []

        def claim(at: float) -> None:
            go.wait()
            if registry.claim_first_served(tenant_id, version, at):
                won.append(at)

        threads = [threading.Thread(target=claim, args=(at,)) for at in (10.0 + attempt, 20.0 + attempt)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, won
        assert registry.first_served_at(tenant_id, version) == won[0]
        assert not registry.claim_first_served(tenant_id, version, 99.0)   # later ones lose too
    assert registry.first_served_at(tenant_id, 999) is None


def test_the_tenants_median_weighs_every_event_of_every_served_version(registry, tenant_id):
    registry.create_tenant(tenant_id)
    _version(registry, tenant_id, 1, 140.0, {"fb-1": 100.0})                        # served at 200: 100 s
    _version(registry, tenant_id, 2, 240.0, {"fb-2": 230.0, "fb-3": 235.0, "fb-4": 238.0, "fb-5": None})
    _version(registry, tenant_id, 3, 300.0, {"fb-6": 290.0})                        # never served: not counted
    assert registry.freshness_p50(tenant_id) is None
    registry.claim_first_served(tenant_id, 1, 200.0)
    registry.claim_first_served(tenant_id, 2, 250.0)                              # 20, 15 and 12 s
    assert registry.event_freshness(tenant_id) == {1: [100.0], 2: [20.0, 15.0, 12.0]}
    # event-weighted: the median of 100, 20, 15, 12 is 17.5; a median of the versions' medians would be 57.5
    assert registry.freshness_p50(tenant_id) == 17.5

    summary = FreshnessSummary.of(registry.lineage(tenant_id, 2), 250.0, 240.0)
    registry.record_freshness(tenant_id, 2, summary)
    assert registry.freshness(tenant_id) == {2: summary}
    assert (summary.events, summary.unmeasured, summary.published_to_served_s) == (3, 1, 10.0)


def test_pruned_versions_take_their_freshness_records_with_them(registry, redis_client, tenant_id):
    registry.create_tenant(tenant_id)
    for v in (1, 2):
        _version(registry, tenant_id, v, 100.0 * v, {f"fb-{v}": 100.0 * v - 5})
        registry.claim_first_served(tenant_id, v, 100.0 * v + 1)
        registry.record_freshness(tenant_id, v, FreshnessSummary.of(registry.lineage(tenant_id, v), 100.0 * v + 1,
                                                                    100.0 * v))
    registry.delete_adapter_versions(tenant_id, [1])
    assert [v.version for v in registry.adapter_versions(tenant_id)] == [2]
    assert registry.lineage(tenant_id, 1) == VersionLineage() and registry.first_served_at(tenant_id, 1) is None
    assert list(registry.freshness(tenant_id)) == [2] and registry.event_freshness(tenant_id) == {2: [6.0]}
    assert not redis_client.exists(f"clora:tenant:{tenant_id}:lineage:1")

"""Fenced registry writes (`clora.fencing`) on the real Redis: a learner whose lease on a tenant
was taken over can no longer claim a version number, record a version or its lineage, or make a
version live; version numbers are never handed out twice."""

from __future__ import annotations

import pytest

from clora.fencing import Fence, FencedOut
from clora.freshness import VersionLineage
from clora.registry import AdapterVersion, RegistryError


def _version(n: int) -> AdapterVersion:
    return AdapterVersion(version=n, path=f"/adapters/v{n}", base_model="tiny")


def test_a_stale_holders_version_writes_are_refused_and_change_nothing(registry, redis_client, tenant_id):
    registry.create_tenant(tenant_id)
    lease = f"test:lease:{{{tenant_id}}}"
    old, new = Fence(lease, "learner-a", 1), Fence(lease, "learner-b", 2)
    redis_client.set(lease, old.value)
    assert registry.claim_version(tenant_id, 1, fence=old) == 1
    registry.record_adapter_version(tenant_id, _version(1), fence=old)
    registry.set_live_version(tenant_id, 1, fence=old)
    redis_client.set(lease, new.value)              # learner-a's lease lapsed; learner-b took the tenant
    for write in (lambda: registry.claim_version(tenant_id, 2, fence=old),
                  lambda: registry.record_lineage(tenant_id, 2, VersionLineage(accepted_at={"fb-1": 1.0}), fence=old),
                  lambda: registry.record_adapter_version(tenant_id, _version(2), fence=old),
                  lambda: registry.set_live_version(tenant_id, 1, fence=old)):
        with pytest.raises(FencedOut, match="no longer held by learner-a with token 1"):
            write()
    assert [v.version for v in registry.adapter_versions(tenant_id)] == [1] and registry.live_version(tenant_id) == 1
    assert registry.lineage(tenant_id, 2).events == 0
    assert registry.claim_version(tenant_id, 2, fence=new) == 2     # the current holder goes on
    registry.record_adapter_version(tenant_id, _version(2), fence=new)
    registry.set_live_version(tenant_id, 2, fence=new)
    assert registry.live_version(tenant_id) == 2
    redis_client.delete(lease)                      # lapsed, nobody holds it: nobody with a fence writes
    with pytest.raises(FencedOut):
        registry.set_live_version(tenant_id, 1, fence=new)


def test_a_claimed_number_is_never_handed_out_again(registry, tenant_id):
    registry.create_tenant(tenant_id)
    # two learners each see the store's newest version as 4, one after the other
    assert registry.claim_version(tenant_id, 5) == 5
    assert registry.claim_version(tenant_id, 5) == 6                 # 5 was taken, never written
    assert registry.claim_version(tenant_id, 9) == 9                 # the store knows a higher one
    assert registry.claim_version(tenant_id, 1) == 10


def test_unfenced_writes_behave_as_before(registry, tenant_id):
    registry.create_tenant(tenant_id)
    registry.record_adapter_version(tenant_id, _version(1))
    with pytest.raises(RegistryError, match="already has adapter version 1"):
        registry.record_adapter_version(tenant_id, _version(1))
    with pytest.raises(RegistryError, match="no adapter version 3"):
        registry.set_live_version(tenant_id, 3)
    registry.set_live_version(tenant_id, 1)
    assert registry.live_version(tenant_id) == 1
    registry.set_live_version(tenant_id, None)
    assert registry.live_version(tenant_id) is None

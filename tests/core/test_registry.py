"""The registry in real Redis: tenants, hashed keys, learning policies, the adapter a tenant
starts from."""

from __future__ import annotations

import pytest

from clora.registry import (ADAPTER_FILES, InvalidTenantField, LearningPolicy, RegistryError, TenantNotFound,
                            hash_key)

pytestmark = pytest.mark.integration


def test_tenant_key_lifecycle(registry, redis_client, tenant_id):
    tenant, key = registry.create_tenant(tenant_id, name="Acme")
    assert registry.authenticate(key).tenant == tenant_id
    # only the hash is stored anywhere in Redis
    dump = b"".join(redis_client.dump(k) or b"" for k in redis_client.keys("clora:*"))
    assert key.encode() not in dump and hash_key(key).encode() in b"".join(redis_client.keys("clora:apikey:*"))
    with pytest.raises(RegistryError):
        registry.create_tenant(tenant_id)

    new = registry.rotate_key(tenant_id)
    assert registry.authenticate(key) is None
    assert registry.authenticate(new).tenant == tenant_id
    key_id = registry.authenticate(new).key_id
    registry.revoke_key(tenant_id, key_id)
    assert registry.authenticate(new) is None
    assert [k.revoked_at is not None for k in registry.list_keys(tenant_id)] == [True, True]


def test_policy_is_validated(registry, tenant_id):
    registry.create_tenant(tenant_id)
    assert registry.update_policy(tenant_id, learning_rate=1e-3, paused=True).paused
    with pytest.raises(ValueError, match="learning_rate"):
        registry.update_policy(tenant_id, learning_rate=-1)
    with pytest.raises(ValueError, match="nonsense"):
        registry.update_policy(tenant_id, nonsense=1)
    assert registry.get_tenant(tenant_id).policy == LearningPolicy(learning_rate=1e-3, paused=True)


def test_bad_tenant_ids_are_refused(registry):
    for bad in ["", "UPPER", "has space", "x" * 80, "../etc"]:
        with pytest.raises(ValueError, match="tenant id"):
            registry.create_tenant(bad)


def _adapter_folder(folder, files=ADAPTER_FILES):
    folder.mkdir()
    for f in files:
        (folder / f).write_text("{}")
    return folder


def test_init_adapter_is_checked_and_stored_absolute(registry, tenant_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _adapter_folder(tmp_path / "my-lora")
    tenant, _ = registry.create_tenant(tenant_id, init_adapter="my-lora")
    assert tenant.init_adapter == str(tmp_path / "my-lora")
    assert registry.get_tenant(tenant_id).init_adapter == str(tmp_path / "my-lora")

    _adapter_folder(tmp_path / "half", files=("adapter_config.json",))
    for bad, says in [("nowhere", "is not a directory"), ("half", "missing adapter_model.safetensors")]:
        with pytest.raises(InvalidTenantField, match=says) as e:
            registry.create_tenant(tenant_id + "-b", init_adapter=bad)
        assert e.value.field == "init_adapter" and str(e.value).startswith("init_adapter: ")
        with pytest.raises(TenantNotFound):   # nothing half-written
            registry.get_tenant(tenant_id + "-b")
    assert tenant_id + "-b" not in [t.id for t in registry.list_tenants()]

"""The registry in real Redis: tenants, hashed keys, learning policies, the adapter a tenant
starts from."""

from __future__ import annotations

import pytest

from clora.registry import (ADAPTER_FILES, InvalidTenantField, LearningPolicy, RegistryError, TenantNotFound,
                            hash_key)
from clora.reward_spec import Reward, Untrained

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


def test_reserved_names_are_refused_as_tenant_ids(registry, redis_client, tenant_id):
    """A tenant called `base` would have its model name serve the frozen base model."""
    from clora.registry import Registry

    with pytest.raises(InvalidTenantField, match="'base' is reserved") as e:
        registry.create_tenant("base")
    assert e.value.field == "id"
    platform = Registry(redis_client, reserved_ids=[tenant_id])   # a platform serving its base model by that name
    with pytest.raises(InvalidTenantField, match="reserved"):
        platform.create_tenant(tenant_id)
    for name in ("base", tenant_id):
        with pytest.raises(TenantNotFound):   # nothing half-written
            registry.get_tenant(name)


def test_an_id_that_reaches_another_key_layout_names_no_tenant(registry, tenant_id):
    """`acme:keys` would read the hash of acme's keys as a tenant (WRONGTYPE): never a key."""
    registry.create_tenant(tenant_id)
    for bad in [f"{tenant_id}:keys", f"{tenant_id}:versions", f"{tenant_id}\n", "a\x00b", "*", ""]:
        with pytest.raises(TenantNotFound, match="a tenant id is"):
            registry.get_tenant(bad)
        with pytest.raises(TenantNotFound):
            registry.list_keys(bad)


def test_a_policy_change_named_like_an_argument_is_refused_as_a_field(registry, tenant_id):
    registry.create_tenant(tenant_id)
    for name in ("tenant_id", "self"):
        with pytest.raises(ValueError, match=name):
            registry.update_policy(tenant_id, **{name: 1})


@pytest.mark.parametrize("path, says", [("/tmp/a\x00b", "NUL"), ("/tmp/" + "a" * 5000, "cannot be read")])
def test_an_unreadable_init_adapter_path_is_an_invalid_field(registry, tenant_id, path, says):
    with pytest.raises(InvalidTenantField, match=says) as e:
        registry.create_tenant(tenant_id, init_adapter=path)
    assert e.value.field == "init_adapter"


def test_a_tenant_with_an_id_from_before_ids_were_matched_whole_is_left_out_of_the_list(registry, redis_client,
                                                                                        tenant_id):
    registry.create_tenant(tenant_id)
    legacy = tenant_id + "-old\n"
    redis_client.sadd("clora:tenants", legacy)
    try:
        assert tenant_id in [t.id for t in registry.list_tenants()]
    finally:
        redis_client.srem("clora:tenants", legacy)


def test_claim_response_records_each_choice_and_how_many_there_were(registry, redis_client, tenant_id):
    import asyncio

    import redis.asyncio

    from clora.registry import MultiChoiceResponse, fetch_multi_choice

    one = registry.claim_response(f"{tenant_id}-one", tenant_id, 1)
    three = registry.claim_response(f"{tenant_id}-three", tenant_id, 3)
    assert one == [f"{tenant_id}-one"] and three == [f"{tenant_id}-three-{i}" for i in range(3)]
    assert registry.interaction_owners(one + three) == [tenant_id] * 4
    registry.claim_interaction(f"{tenant_id}-old-0", tenant_id)   # a gateway that records the choices only

    async def lookup(ids):
        client = redis.asyncio.Redis(connection_pool=redis.asyncio.ConnectionPool(
            **redis_client.connection_pool.connection_kwargs))
        try:
            return await fetch_multi_choice(client, ids)
        finally:
            await client.aclose()

    found = asyncio.run(lookup([f"{tenant_id}-one", f"{tenant_id}-three", f"{tenant_id}-old", "unknown"]))
    assert found == [None, MultiChoiceResponse(f"{tenant_id}-three", tenant_id, 3),
                     MultiChoiceResponse(f"{tenant_id}-old", tenant_id, None), None]
    assert found[1].describe_ids() == ", ".join(three)
    assert found[2].describe_ids() == f"{tenant_id}-old-0, {tenant_id}-old-1, ..."


def test_a_reward_spec_is_stored_with_the_policy_and_a_bad_one_changes_nothing(registry, tenant_id):
    registry.create_tenant(tenant_id)
    spec = {"keys": {"thumbs": {"type": "bool", "weight": 2.0, "sources": ["user"]}}}
    assert registry.update_policy(tenant_id, reward_spec=spec).reward_spec.keys["thumbs"].weight == 2.0
    with pytest.raises(ValueError, match=r"reward_spec\.keys\.thumbs\.sources"):
        registry.update_policy(tenant_id, reward_spec={"keys": {"thumbs": {"type": "bool", "sources": ["bot"]}}})
    stored = registry.get_tenant(tenant_id).policy.reward_spec
    assert stored.judge("thumbs", "user", 1) == Reward(1.0, 2.0)
    assert stored.judge("thumbs", "judge", 1) == Untrained("untrusted_source")


def test_a_tinker_sampler_path_maps_to_its_version_for_its_tenant_only(registry, stack, tenant_id):
    import asyncio

    import redis.asyncio

    from clora.registry import AdapterVersion, fetch_tinker_sampler_version

    other = tenant_id + "-b"
    registry.create_tenant(tenant_id)
    registry.create_tenant(other)
    path = "tinker://s1:train:0/sampler_weights/final"
    registry.record_adapter_version(tenant_id, AdapterVersion(version=3, path="/a/v3", base_model="tiny",
                                                              source="tinker", tinker_path=path))
    recorded = registry.adapter_version(tenant_id, 3)
    assert (recorded.source, recorded.tinker_path) == ("tinker", path) and registry.live_version(tenant_id) is None
    assert registry.tinker_sampler_version(tenant_id, path) is None
    with pytest.raises(RegistryError, match="no adapter version 4"):
        registry.record_tinker_sampler(tenant_id, path, 4)
    with pytest.raises(RegistryError, match="not a tinker:// path"):
        registry.record_tinker_sampler(tenant_id, "/a/v3", 3)
    registry.record_tinker_sampler(tenant_id, path, 3)
    assert registry.tinker_sampler_version(tenant_id, path) == 3
    assert registry.tinker_sampler_version(other, path) is None            # another tenant's path: unknown
    assert registry.tinker_sampler_version(tenant_id, path + "x") is None

    async def fetched(tenant: str) -> int | None:
        client = redis.asyncio.Redis.from_url(stack.redis_url)
        try:
            return await fetch_tinker_sampler_version(client, tenant, path)
        finally:
            await client.aclose()

    assert asyncio.run(fetched(tenant_id)) == 3 and asyncio.run(fetched(other)) is None
    with pytest.raises(TenantNotFound):
        registry.tinker_sampler_version("acme:keys", path)



def test_a_tenant_is_deleted_in_three_steps_each_safe_to_repeat(registry, redis_client, tenant_id):
    _, key = registry.create_tenant(tenant_id)
    other, other_key = registry.create_tenant(tenant_id + "-2")   # shares the prefix, must survive
    with pytest.raises(RegistryError, match="in service"):
        registry.purge_tenant(tenant_id)                            # data goes only after retiring
    for _ in range(2):
        registry.retire_tenant(tenant_id)
    assert registry.authenticate(key) is None and tenant_id not in [t.id for t in registry.list_tenants()]
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id)
    assert registry.get_tenant(tenant_id, retired=True).retired_at is not None
    with pytest.raises(RegistryError, match="being deleted"):
        registry.create_tenant(tenant_id)
    assert registry.purge_tenant(tenant_id) >= 1 and registry.purge_tenant(tenant_id) == 0
    registry.drop_tenant(tenant_id)
    assert redis_client.keys(f"clora:tenant:{tenant_id}") == [] and redis_client.keys(f"clora:tenant:{tenant_id}:*") == []
    with pytest.raises(TenantNotFound):
        registry.retire_tenant(tenant_id)
    assert registry.authenticate(other_key).tenant == other.id and registry.list_keys(other.id)


def test_a_step_that_began_before_a_tenant_was_retired_publishes_nothing(registry, redis_client, tenant_id):
    """A learner step running when its tenant is deleted: the version's number and its record
    are refused once the tenant is retired, so nothing of it outlives the purge."""
    from clora.registry import AdapterVersion

    registry.create_tenant(tenant_id)
    n = registry.claim_version(tenant_id, 1)                  # claimed before the delete began
    registry.retire_tenant(tenant_id)
    with pytest.raises(TenantNotFound, match="being deleted or gone"):
        registry.record_adapter_version(tenant_id, AdapterVersion(version=n, path=f"/a/v{n}", base_model="tiny"))
    with pytest.raises(TenantNotFound, match="being deleted or gone"):
        registry.claim_version(tenant_id, n + 1)
    registry.purge_tenant(tenant_id)
    registry.drop_tenant(tenant_id)
    with pytest.raises(TenantNotFound):
        registry.claim_version(tenant_id, 1)
    assert redis_client.keys(f"clora:tenant:{tenant_id}*") == []

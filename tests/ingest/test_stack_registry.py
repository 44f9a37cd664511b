"""The embedded stack starts real services, and the registry keeps tenants and hashed keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clora.infra.registry import LearningPolicy, RegistryError, hash_key

pytestmark = pytest.mark.integration


def test_generic_module_names_stay_free(tmp_path):
    code = ("import importlib.util as u, clora.ingest, clora.kernels, clora.agents;"
            "print(u.find_spec('kernels'), u.find_spec('agents'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None None"


def test_stack_services_answer(stack, redis_client):
    from kafka import KafkaAdminClient

    assert redis_client.ping()
    assert redis_client.config_get("appendonly")["appendonly"] == "yes"
    admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap)
    assert {"clora.feedback", "clora.interactions", "clora.dlq", "clora.adapters"} <= set(admin.list_topics())
    admin.close()
    assert all(p.exists() for p in stack.log_paths().values())


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


def test_external_urls_start_nothing(tmp_path, stack):
    from clora.infra.settings import PlatformSettings
    from clora.infra.stack import LocalStack

    ext = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=stack.kafka_bootstrap,
                                               redis_url=stack.redis_url))
    with ext:
        assert ext.processes == {}
        assert ext.kafka_bootstrap == stack.kafka_bootstrap and ext.redis_url == stack.redis_url
    assert not (tmp_path / "logs").exists()


def test_settings_come_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    from clora.infra.settings import IngestSettings, PlatformSettings, WebhookSettings

    monkeypatch.setenv("CLORA_KAFKA_BOOTSTRAP", "kafka:9092")
    monkeypatch.setenv("CLORA_WEBHOOK_MAX_BATCH", "7")
    assert PlatformSettings().kafka_bootstrap == "kafka:9092"
    assert WebhookSettings().max_batch == 7
    monkeypatch.setenv("CLORA_INGEST_EVICTION", "lru")
    with pytest.raises(ValidationError, match="eviction"):
        IngestSettings()

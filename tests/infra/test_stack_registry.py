"""The embedded stack starts real services, and the registry keeps tenants and hashed keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clora.registry import InvalidTenantField, LearningPolicy, RegistryError, TenantNotFound, hash_key

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


def _adapter_folder(folder, files=("adapter_config.json", "adapter_model.safetensors")):
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


def test_cli_tenant_create_with_an_adapter(stack, registry, tenant_id, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_REDIS_URL", stack.redis_url)
    monkeypatch.chdir(tmp_path)
    _adapter_folder(tmp_path / "my-lora")
    runner = CliRunner()
    ok = runner.invoke(app, ["tenant", "create", tenant_id, "--adapter", "./my-lora", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["init_adapter"] == str(tmp_path / "my-lora")
    assert registry.get_tenant(tenant_id).init_adapter == str(tmp_path / "my-lora")
    bad = runner.invoke(app, ["tenant", "create", tenant_id + "-b", "--adapter", "./nowhere"])
    said = " ".join(bad.output.split())  # rich wraps long lines
    assert bad.exit_code == 2 and said.startswith("error: init_adapter: ")
    assert said.endswith("nowhere is not a directory")
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id + "-b")


def test_external_urls_start_nothing(tmp_path, stack):
    from clora.settings import PlatformSettings
    from clora.infra.stack import LocalStack

    ext = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=stack.kafka_bootstrap,
                                               redis_url=stack.redis_url))
    with ext:
        assert ext.processes == {}
        assert ext.kafka_bootstrap == stack.kafka_bootstrap and ext.redis_url == stack.redis_url
    assert not (tmp_path / "logs").exists()


def test_settings_come_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    from clora.ingest.settings import IngestSettings, WebhookSettings
    from clora.settings import PlatformSettings

    monkeypatch.setenv("CLORA_KAFKA_BOOTSTRAP", "kafka:9092")
    monkeypatch.setenv("CLORA_WEBHOOK_MAX_BATCH", "7")
    assert PlatformSettings().kafka_bootstrap == "kafka:9092"
    assert WebhookSettings().max_batch == 7
    monkeypatch.setenv("CLORA_INGEST_EVICTION", "lru")
    with pytest.raises(ValidationError, match="eviction"):
        IngestSettings()

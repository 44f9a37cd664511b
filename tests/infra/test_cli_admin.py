"""The admin CLI as a user runs it, `python -m clora.infra.cli ...` in a subprocess, against a real
control API (and Redis): every command through the API, `--json` that parses, the exit codes
(3 not found, 4 refused, 5 unreachable, 6 unauthorized) with one line on stderr, `--url` and
`--token` reaching another control API, and `--version`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest

from clora.ingest.schemas import TOPIC_ADAPTERS, DeadLetter
from clora.registry import TenantNotFound
from tests.kafka_read import read_keyed

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def clora(console, tmp_path):
    """Run `clora ...` in a subprocess aimed at the test console by CLORA_CONTROL_URL/TOKEN."""
    env = {**os.environ, "CLORA_CONTROL_URL": console.url, "CLORA_CONTROL_TOKEN": console.token,
           "COLUMNS": "200"}

    def run(*args: str, stdin: str | None = None, **extra_env: str) -> Ran:
        p = subprocess.run([sys.executable, "-m", "clora.infra.cli", *args], env={**env, **extra_env},
                           input=stdin, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        return Ran(p.returncode, p.stdout, p.stderr)
    return run


def test_version_prints_the_package_version(clora):
    r = clora("--version")
    assert r.code == 0 and r.out.strip() == f"clora {importlib.metadata.version('clora')}"


def test_tenant_lifecycle_through_the_control_api(clora, registry, tenant_id):
    made = clora("tenant", "create", tenant_id, "--name", "Acme", "--signing-secret", "--json")
    assert made.code == 0, made.err
    key = made.json()["api_key"]
    assert registry.authenticate(key).tenant == tenant_id and made.json()["signing_secret"]
    assert registry.get_tenant(tenant_id).signing_secret == made.json()["signing_secret"]
    listed = clora("tenant", "list", "--json")
    assert listed.code == 0
    mine = [t for t in listed.json()["tenants"] if t["id"] == tenant_id]
    assert mine and mine[0]["name"] == "Acme" and mine[0]["active_keys"] == 1
    shown = clora("tenant", "show", tenant_id, "--json")
    assert shown.code == 0 and shown.json()["id"] == tenant_id

    assert clora("tenant", "pause", tenant_id).code == 0 and registry.get_tenant(tenant_id).policy.paused
    assert clora("tenant", "resume", tenant_id).code == 0 and not registry.get_tenant(tenant_id).policy.paused

    rotated = clora("tenant", "rotate-key", tenant_id, "--json")
    assert rotated.code == 0 and registry.authenticate(key) is None
    assert registry.authenticate(rotated.json()["api_key"]).tenant == tenant_id

    tinker = clora("tinker-key", "create", "--tenant", tenant_id, "--json")
    assert tinker.code == 0 and registry.authenticate_tinker(tinker.json()["tinker_key"]).tenant == tenant_id
    keys = clora("tinker-key", "list", "--tenant", tenant_id, "--json").json()["tinker_keys"]
    assert [k["key_id"] for k in keys] == [tinker.json()["key_id"]]

    versions = clora("tenant", "versions", tenant_id, "--json")
    assert versions.code == 0 and versions.json()["versions"] == [] and versions.json()["live"] is None


def test_policy_get_and_set_validated_by_the_api(clora, registry, tenant_id):
    registry.create_tenant(tenant_id)
    r = clora("policy", "set", tenant_id, "learning_rate=0.001", "algorithm=sft", "fresh_fraction=1", "--json")
    assert r.code == 0, r.err
    assert r.json()["learning_rate"] == 0.001 and r.json()["algorithm"] == "sft"
    policy = registry.get_tenant(tenant_id).policy
    assert (policy.learning_rate, policy.algorithm, policy.fresh_fraction) == (0.001, "sft", 1.0)
    got = clora("policy", "get", tenant_id, "--json")
    assert got.code == 0 and got.json()["algorithm"] == "sft"
    bad = clora("policy", "set", tenant_id, "batch_size=0", "learning_rate=0.5")
    assert bad.code == 4 and bad.err.strip().startswith("error: batch_size: "), bad.err
    assert len(bad.err.strip().splitlines()) == 1
    assert registry.get_tenant(tenant_id).policy.learning_rate == 0.001   # nothing changed
    odd = clora("policy", "set", tenant_id, "learning_rate")
    assert odd.code == 2 and "key=value" in odd.err


def test_delete_asks_first_and_removes_the_tenant(clora, registry, tenant_id):
    _, key = registry.create_tenant(tenant_id)
    kept = clora("tenant", "delete", tenant_id, stdin="n\n")
    assert kept.code != 0 and registry.get_tenant(tenant_id).id == tenant_id
    gone = clora("tenant", "delete", tenant_id, stdin="y\n")
    assert gone.code == 0, gone.err
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id, retired=True)
    assert registry.authenticate(key) is None
    registry.create_tenant(tenant_id)
    r = clora("tenant", "delete", tenant_id, "--yes", "--json")
    assert r.code == 0 and r.json() == {"deleted": tenant_id}


def test_dlq_list_and_replay(clora, stack, redis_client):
    from clora.ingest.reports import record_dead_letters

    key = f"dlq-{uuid.uuid4().hex[:8]}"
    letter = DeadLetter(source_topic=TOPIC_ADAPTERS, key=key, reason="test", payload='{"replayed": true}')
    record_dead_letters(redis_client, [letter])
    listed = clora("dlq", "list", "--json")
    assert listed.code == 0 and letter.event_id in [d["event_id"] for d in listed.json()["dead_letters"]]
    replayed = clora("dlq", "replay", letter.event_id, "--json")
    assert replayed.code == 0 and replayed.json() == {"replayed": letter.event_id, "topic": TOPIC_ADAPTERS}
    assert read_keyed(stack.kafka_bootstrap, TOPIC_ADAPTERS, key, lambda v: len(v) >= 1) == [b'{"replayed": true}']
    missing = clora("dlq", "replay", "dl-nothing-" + key)
    assert missing.code == 3 and missing.err.startswith("error: no dead letter")


def test_exit_codes_name_what_went_wrong_on_one_line(clora, registry, tenant_id):
    unknown = clora("tenant", "delete", tenant_id, "--yes")
    assert unknown.code == 3 and unknown.err.strip() == f"error: no tenant {tenant_id!r}"
    registry.create_tenant(tenant_id)
    dup = clora("tenant", "create", tenant_id)
    assert dup.code == 4 and dup.err.strip().startswith("error: id: ") and "already exists" in dup.err
    bad = clora("tenant", "create", "Bad Id")
    assert bad.code == 4 and bad.err.strip().startswith("error: id: ")
    wrong = clora("tenant", "list", "--token", "wrong")
    assert wrong.code == 6 and wrong.err.startswith("error: ") and len(wrong.err.strip().splitlines()) == 1
    from clora.procs import free_port

    nobody = clora("tenant", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert nobody.code == 5 and "cannot reach the control API" in nobody.err
    usage = clora("tenant", "delete")
    assert usage.code == 2


def test_url_and_token_reach_another_control_api(clora, stack, registry, tenant_id):
    """A second control API on another port with its own token: `--url`/`--token` reach it, and
    the environment's (the first API's) would be refused with that token."""
    import redis

    from clora.infra.control import create_control_app
    from clora.ingest.buffers import ReplayBuffer
    from clora.registry import Registry
    from tests.fakes import ServerThread

    client = redis.Redis.from_url(stack.redis_url)
    token = "remote-admin-" + uuid.uuid4().hex
    with ServerThread(create_control_app(Registry(client), ReplayBuffer(client), token), lifespan="auto") as remote:
        made = clora("tenant", "create", tenant_id, "--url", remote.url, "--token", token, "--json")
        assert made.code == 0, made.err
        assert registry.get_tenant(tenant_id).id == tenant_id
        assert clora("tenant", "list", "--token", token).code == 6   # the default URL is the other API
        env = clora("tenant", "show", tenant_id, "--json", CLORA_CONTROL_URL=remote.url, CLORA_CONTROL_TOKEN=token)
        assert env.code == 0 and env.json()["id"] == tenant_id

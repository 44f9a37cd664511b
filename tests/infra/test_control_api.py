"""The control-plane API: nothing without the admin token (tenant keys don't open it),
validated policy edits naming the field, keys shown once, promote / roll back announced on
`clora.adapters`, DLQ replay, and deleting a tenant (all it owns, a retried interrupted delete
included)."""

from __future__ import annotations

import json

import httpx
import pytest

from clora.registry import AdapterVersion, LearningPolicy
from clora.ingest.schemas import TOPIC_ADAPTERS
from tests.kafka_read import read_keyed

pytestmark = pytest.mark.integration

ROUTES = [("GET", "/api/tenants"), ("POST", "/api/tenants"), ("GET", "/api/tenants/x"),
          ("PATCH", "/api/tenants/x/policy"), ("POST", "/api/tenants/x/pause"), ("POST", "/api/tenants/x/keys"),
          ("DELETE", "/api/tenants/x/keys/k"), ("GET", "/api/tenants/x/versions"),
          ("POST", "/api/tenants/x/rollback"), ("GET", "/api/tenants/x/feedback"), ("GET", "/api/dlq"),
          ("POST", "/api/dlq/e/replay"), ("GET", "/api/tenants/x/metrics"), ("GET", "/api/tenants/x/buffers"),
          ("GET", "/api/tenants/x/traffic"), ("GET", "/api/platform/events"), ("GET", "/api/tenants/x/freshness"),
          ("POST", "/api/tenants/x/tinker-keys"), ("GET", "/api/tenants/x/tinker-keys"),
          ("DELETE", "/api/tenants/x/tinker-keys/k"), ("GET", "/api/engine"), ("DELETE", "/api/tenants/x")]


def admin(console) -> dict[str, str]:
    return {"Authorization": f"Bearer {console.token}"}


@pytest.mark.parametrize("method, path", ROUTES)
def test_nothing_without_the_admin_token(console, registry, tenant_id, method, path):
    _, tenant_key = registry.create_tenant(tenant_id)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {tenant_key}"}):
        r = httpx.request(method, console.url + path, headers=headers, json={})
        assert r.status_code == 401, (headers, r.text)
        assert "tenant" not in r.text.lower() or "admin" in r.text.lower()


def test_create_tenant_shows_key_once(console, registry, tenant_id):
    r = httpx.post(f"{console.url}/api/tenants", headers=admin(console), json={"id": tenant_id, "name": "Acme"})
    assert r.status_code == 201
    key = r.json()["api_key"]
    assert registry.authenticate(key).tenant == tenant_id
    detail = httpx.get(f"{console.url}/api/tenants/{tenant_id}", headers=admin(console)).text
    assert key not in detail and key not in httpx.get(f"{console.url}/api/tenants", headers=admin(console)).text
    dup = httpx.post(f"{console.url}/api/tenants", headers=admin(console), json={"id": tenant_id})
    assert dup.status_code == 409
    bad = httpx.post(f"{console.url}/api/tenants", headers=admin(console), json={"id": "Bad Id"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "id"


def test_create_tenant_from_an_adapter_folder(console, registry, tenant_id, tmp_path):
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    url = f"{console.url}/api/tenants"
    bad = httpx.post(url, headers=admin(console), json={"id": tenant_id, "init_adapter": str(tmp_path / "lora")})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "init_adapter"
    assert "missing adapter_model.safetensors" in bad.json()["error"]["message"]
    assert tenant_id not in [t.id for t in registry.list_tenants()]  # nothing half-written
    (tmp_path / "lora" / "adapter_model.safetensors").write_bytes(b"")
    r = httpx.post(url, headers=admin(console), json={"id": tenant_id, "init_adapter": str(tmp_path / "lora")})
    assert r.status_code == 201 and registry.get_tenant(tenant_id).init_adapter == str(tmp_path / "lora")


def test_policy_edits_are_validated(console, registry, tenant_id):
    registry.create_tenant(tenant_id)
    url = f"{console.url}/api/tenants/{tenant_id}/policy"
    r = httpx.patch(url, headers=admin(console), json={"learning_rate": 0.001, "algorithm": "dpo"})
    assert r.status_code == 200 and r.json()["algorithm"] == "dpo"
    r = httpx.patch(url, headers=admin(console), json={"batch_size": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "batch_size"
    r = httpx.patch(url, headers=admin(console), json={"algorithm": "magic"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "algorithm"
    r = httpx.patch(url, headers=admin(console), json={"fresh_fraction": 1.5})
    assert r.status_code == 422 and r.json()["error"]["field"] == "fresh_fraction"
    r = httpx.patch(url, headers=admin(console), json={"fresh_fraction": 1.0})
    assert r.status_code == 200 and registry.get_tenant(tenant_id).policy.fresh_fraction == 1.0
    assert registry.get_tenant(tenant_id).policy.algorithm == "dpo"
    assert httpx.post(f"{console.url}/api/tenants/{tenant_id}/pause", headers=admin(console)).json()["paused"]
    assert registry.get_tenant(tenant_id).policy.paused


STARS = {"type": "scale", "lo": 1, "hi": 5, "weight": 0.5, "sources": ["user", "operator"]}


def test_the_reward_spec_is_edited_through_the_policy_and_shown_with_what_it_left_untrained(
        console, registry, redis_client, tenant_id):
    from clora.ingest.buffers import PendingWrite, ReplayBuffer

    registry.create_tenant(tenant_id)
    url = f"{console.url}/api/tenants/{tenant_id}"
    assert httpx.get(url, headers=admin(console)).json()["untrained_feedback"] == {}
    r = httpx.patch(url + "/policy", headers=admin(console), json={"reward_spec": {"keys": {"stars": STARS}}})
    assert r.status_code == 200 and r.json()["reward_spec"]["keys"]["stars"]["weight"] == 0.5
    assert registry.get_tenant(tenant_id).policy.reward_spec.keys["stars"].hi == 5
    r = httpx.patch(url + "/policy", headers=admin(console), json={"learning_rate": 0.01})   # other edits keep it
    assert r.status_code == 200 and r.json()["reward_spec"]["keys"]["stars"]["sources"] == ["user", "operator"]
    ReplayBuffer(redis_client).add_many(tenant_id, [PendingWrite("fb1", [], "", untrained="unknown_key"),
                                                    PendingWrite("fb2", [], "", untrained="unknown_key"),
                                                    PendingWrite("fb3", [], "", untrained="out_of_range")], now=1.0)
    detail = httpx.get(url, headers=admin(console)).json()
    assert detail["untrained_feedback"] == {"unknown_key": 2, "out_of_range": 1}
    assert detail["policy"]["reward_spec"] == {"keys": {"stars": {**STARS, "invert": False}}}
    r = httpx.patch(url + "/policy", headers=admin(console), json={"reward_spec": None})
    assert r.status_code == 200 and registry.get_tenant(tenant_id).policy.reward_spec is None


@pytest.mark.parametrize("spec, field", [
    ({"keys": {"stars": {**STARS, "type": "stars"}}}, "reward_spec.keys.stars.type"),
    ({"keys": {"stars": {**STARS, "lo": 5, "hi": 1}}}, "reward_spec.keys.stars.hi"),
    ({"keys": {"stars": {**STARS, "weight": 0}}}, "reward_spec.keys.stars.weight"),
    ({"keys": {"stars": {**STARS, "sources": ["user", "robot"]}}}, "reward_spec.keys.stars.sources.1"),
    ({"keys": {f"k{i}": STARS for i in range(33)}}, "reward_spec.keys"),
    ({"keys": {"Stars!": STARS}}, "reward_spec.keys.Stars!.[key]"),
    ({"stars": STARS}, "reward_spec.keys"),          # the keys go under "keys"
    ("stars", "reward_spec"),
])
def test_a_bad_reward_spec_is_422_naming_the_field(console, registry, tenant_id, spec, field):
    registry.create_tenant(tenant_id)
    r = httpx.patch(f"{console.url}/api/tenants/{tenant_id}/policy", headers=admin(console),
                    json={"reward_spec": spec, "learning_rate": 0.01})
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert r.json()["error"]["message"].startswith(field + ": ")
    assert registry.get_tenant(tenant_id).policy == LearningPolicy()   # nothing half-written


def test_key_rotation_and_revocation(console, registry, tenant_id):
    _, first = registry.create_tenant(tenant_id)
    new = httpx.post(f"{console.url}/api/tenants/{tenant_id}/keys/rotate", headers=admin(console)).json()["api_key"]
    assert registry.authenticate(first) is None and registry.authenticate(new).tenant == tenant_id
    key_id = registry.authenticate(new).key_id
    assert httpx.delete(f"{console.url}/api/tenants/{tenant_id}/keys/{key_id}", headers=admin(console)).status_code == 200
    assert registry.authenticate(new) is None
    assert httpx.delete(f"{console.url}/api/tenants/{tenant_id}/keys/nope", headers=admin(console)).status_code == 404


def _versions(registry, tenant_id, n):
    for v in range(1, n + 1):
        registry.record_adapter_version(tenant_id, AdapterVersion(
            version=v, path=f"/adapters/{tenant_id}/v{v}", base_model="tiny", parent_version=v - 1 if v > 1 else None,
            step=v * 10, examples_seen=v * 80, eval_scores={"heldout": 0.1 * v}))
    registry.set_live_version(tenant_id, n)


def test_versions_the_learner_deleted_are_gone_from_the_api(console, registry, tenant_id, request):
    registry.create_tenant(tenant_id)
    _versions(registry, tenant_id, 4)
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))
    registry.delete_adapter_versions(tenant_id, [1, 2])  # the learner's retention
    listed = httpx.get(f"{console.url}/api/tenants/{tenant_id}/versions", headers=admin(console)).json()
    assert [v["version"] for v in listed["versions"]] == [3, 4] and listed["live"] == 4
    r = httpx.post(f"{console.url}/api/tenants/{tenant_id}/versions/1/promote", headers=admin(console))
    assert r.status_code == 404


def test_each_served_versions_feedback_to_served_latency_is_listed_with_the_tenants(console, registry, tenant_id,
                                                                                  request):
    from clora.freshness import FreshnessSummary, VersionLineage

    registry.create_tenant(tenant_id)
    _versions(registry, tenant_id, 3)
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))
    get = lambda route: httpx.get(f"{console.url}/api/tenants/{tenant_id}/{route}", headers=admin(console)).json()
    assert get("freshness") == {"events": 0, "p50_s": None, "p99_s": None, "versions": []}
    for v, events in ((2, {"fb-1": 100.0}), (3, {"fb-2": 190.0, "fb-3": 196.0})):   # v1: never served
        registry.record_lineage(tenant_id, v, VersionLineage(accepted_at=events))
        registry.claim_first_served(tenant_id, v, 100.0 * v)
        registry.record_freshness(tenant_id, v, FreshnessSummary.of(registry.lineage(tenant_id, v), 100.0 * v,
                                                                    100.0 * v - 4))
    fresh = get("freshness")
    assert (fresh["events"], fresh["p50_s"]) == (3, 104.0)          # the median of 100, 110 and 104 s
    assert [(v["version"], v["events"], v["p50_s"], v["published_to_served_s"]) for v in fresh["versions"]] == \
        [(2, 1, 100.0, 4.0), (3, 2, 107.0, 4.0)]
    listed = {v["version"]: v["freshness"] for v in get("versions")["versions"]}
    assert listed[1] is None and listed[3]["p99_s"] == pytest.approx(109.94)


def test_a_failing_tenant_shows_its_last_error_until_a_step_succeeds(console, registry, tenant_id):
    registry.create_tenant(tenant_id)

    def summary() -> dict:
        return httpx.get(f"{console.url}/api/tenants/{tenant_id}", headers=admin(console)).json()

    assert summary()["training_error"] is None
    registry.append_metrics(tenant_id, {"step": 1, "loss": 0.5})
    registry.append_metrics(tenant_id, {"failed": "OSError: [Errno 28] No space left on device", "failures": 1,
                                        "retry_in_s": 5.0})
    assert summary()["training_error"]["error"] == "OSError: [Errno 28] No space left on device"
    registry.append_metrics(tenant_id, {"step": 2, "loss": 0.4})   # it trains again
    assert summary()["training_error"] is None


def test_what_the_guards_did_shows_until_it_is_dealt_with(console, registry, tenant_id):
    """The reward-hacking guard's pause (its reason and alert) shows until an operator resumes;
    the forgetting guard's refusal until a version is published."""
    from clora.registry import TenantAlert

    registry.create_tenant(tenant_id)
    url, headers = f"{console.url}/api/tenants/{tenant_id}", admin(console)
    listed = lambda: next(t for t in httpx.get(f"{console.url}/api/tenants", headers=headers).json()["tenants"]
                          if t["id"] == tenant_id)
    assert listed()["paused_reason"] is None and listed()["drift_refusal"] is None
    registry.update_policy(tenant_id, paused=True, paused_reason="reward hacking: v3 was rolled back to v2: ...")
    registry.record_alert(tenant_id, TenantAlert(kind="reward_hacking", detail="v3 hacked its reward", version=3,
                                                 rolled_back_to=2, facts={"degraded": ["empty"]}))
    registry.append_metrics(tenant_id, {"step": 7, "refused": "drift 5.100 nats/token ... exceeds ...", "drift": 5.1})
    assert listed()["paused_reason"].startswith("reward hacking: v3")
    detail = httpx.get(url, headers=headers).json()
    assert [(a["kind"], a["version"], a["rolled_back_to"]) for a in detail["alerts"]] == [("reward_hacking", 3, 2)]
    assert detail["drift_refusal"] == {"reason": "drift 5.100 nats/token ... exceeds ...", "drift": 5.1,
                                       "time": detail["drift_refusal"]["time"], "step": 7}
    assert httpx.post(f"{url}/resume", headers=headers).json()["paused_reason"] is None
    registry.append_metrics(tenant_id, {"step": 9, "eval": 0.3, "version": 4})
    assert listed()["paused_reason"] is None and listed()["drift_refusal"] is None
    assert len(httpx.get(url, headers=headers).json()["alerts"]) == 1      # the alert stays in the record


def test_rollback_and_promote_are_announced(stack, console, registry, tenant_id, request):
    registry.create_tenant(tenant_id)
    _versions(registry, tenant_id, 3)
    # Its versions have no folders: left live, they would keep a later test's gateway retrying them.
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))
    r = httpx.post(f"{console.url}/api/tenants/{tenant_id}/rollback", headers=admin(console), json={})
    assert r.json() == {"live": 2} and registry.live_version(tenant_id) == 2
    r = httpx.post(f"{console.url}/api/tenants/{tenant_id}/versions/3/promote", headers=admin(console))
    assert r.json() == {"live": 3}
    r = httpx.post(f"{console.url}/api/tenants/{tenant_id}/versions/9/promote", headers=admin(console))
    assert r.status_code == 404
    mine = [json.loads(v) for v in read_keyed(stack.kafka_bootstrap, TOPIC_ADAPTERS, tenant_id, lambda vs: len(vs) >= 2)]
    assert [(e["action"], e["version"]) for e in mine] == [("rolled_back", 2), ("promoted", 3)]


def test_dlq_replay_republishes_the_payload(stack, console, redis_client, tenant_id):
    from clora.ingest.reports import record_dead_letters
    from clora.ingest.schemas import DeadLetter

    letter = DeadLetter(source_topic="clora.feedback", key=tenant_id, reason="test", payload='{"fixed": true}')
    record_dead_letters(redis_client, [letter])
    listed = httpx.get(f"{console.url}/api/dlq", headers=admin(console)).json()["dead_letters"]
    assert any(d["event_id"] == letter.event_id for d in listed)
    r = httpx.post(f"{console.url}/api/dlq/{letter.event_id}/replay", headers=admin(console))
    assert r.json()["topic"] == "clora.feedback"
    values = read_keyed(stack.kafka_bootstrap, "clora.feedback", tenant_id, lambda vs: b'{"fixed": true}' in vs)
    assert b'{"fixed": true}' in values


@pytest.mark.parametrize("changes, field", [
    ({"tenant_id": "x"}, "tenant_id"),          # once a TypeError (500): it collided with the argument
    ({"self": 1}, "self"),
    ({"learning_rate": 10**400}, "learning_rate"),
    ([], "body"),
])
def test_odd_policy_bodies_are_422_naming_the_field(console, registry, tenant_id, changes, field):
    registry.create_tenant(tenant_id)
    r = httpx.patch(f"{console.url}/api/tenants/{tenant_id}/policy", headers=admin(console), json=changes)
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert registry.get_tenant(tenant_id).policy == LearningPolicy()   # nothing half-written


def test_a_body_nested_too_deep_is_422_naming_where(console, registry, tenant_id):
    registry.create_tenant(tenant_id)
    deep = b'{"learning_rate": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = httpx.patch(f"{console.url}/api/tenants/{tenant_id}/policy", content=deep,
                    headers={**admin(console), "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"].startswith("learning_rate.0.0"), r.text


@pytest.mark.parametrize("body, field, says", [
    ({"init_adapter": "/tmp/a\x00b"}, "init_adapter", "NUL"),
    ({"init_adapter": "/tmp/" + "a" * 5000}, "init_adapter", "cannot be read"),
    ({"id": "base"}, "id", "reserved"),
    ({"id": "acme\n"}, "id", "tenant id must be"),
])
def test_a_new_tenant_that_cannot_be_is_422_naming_the_field(console, registry, tenant_id, body, field, says):
    r = httpx.post(f"{console.url}/api/tenants", headers=admin(console), json={"id": tenant_id, **body})
    assert r.status_code == 422 and r.json()["error"]["field"] == field and says in r.json()["error"]["message"], r.text
    assert body.get("id", tenant_id) not in [t.id for t in registry.list_tenants()]


@pytest.mark.parametrize("suffix", [":keys", ":versions", ":live", "%0A", ":metrics"])
@pytest.mark.parametrize("route", ["", "/versions", "/buffers", "/feedback", "/metrics", "/traffic", "/policy",
                                   "/keys", "/freshness", "/tinker-keys"])
def test_an_id_that_would_reach_another_redis_key_is_404_naming_tenant_id(console, registry, tenant_id, suffix, route):
    """`acme:keys` once read acme's key hash as a tenant (WRONGTYPE, 500)."""
    _, key = registry.create_tenant(tenant_id)
    registry.append_metrics(tenant_id, {"step": 1})
    method = {"/policy": "PATCH", "/keys": "POST", "/tinker-keys": "POST"}.get(route, "GET")
    r = httpx.request(method, f"{console.url}/api/tenants/{tenant_id}{suffix}{route}", headers=admin(console),
                      json={"paused": True} if method == "PATCH" else None)
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id", r.text
    assert registry.authenticate(key).tenant == tenant_id and not registry.get_tenant(tenant_id).policy.paused


def test_platform_events_list_what_the_supervisor_did_newest_first(console, redis_client):
    import time

    from clora.ingest.reports import ServiceEvent, record_service_event

    marker = f"test-{time.time_ns()}"
    record_service_event(redis_client, ServiceEvent(time=time.time(), service="redis", kind="restarted", detail=marker))
    record_service_event(redis_client, ServiceEvent(time=time.time(), service="broker", kind="data_lost",
                                                    detail=marker + " lost"))
    events = httpx.get(f"{console.url}/api/platform/events?n=2", headers=admin(console)).json()["events"]
    assert [(e["service"], e["kind"], e["detail"]) for e in events] == [
        ("broker", "data_lost", marker + " lost"), ("redis", "restarted", marker)]
    for n in ("0", "-5", str(10**9)):  # clamped, never an error
        assert httpx.get(f"{console.url}/api/platform/events?n={n}", headers=admin(console)).status_code == 200
    assert httpx.get(f"{console.url}/api/platform/events?n=x", headers=admin(console)).status_code == 422


def test_the_engine_view_lists_each_gateways_replicas_and_what_they_refused(console, registry):
    """A gateway's report (`EngineManager.report`, written every few seconds) reaches the console:
    a replica out of rotation for an adapter whose canary failed says so, with the reason."""
    import uuid

    gateway = f"gw-{uuid.uuid4().hex[:6]}"
    refused = {"adapter": "acme@v3", "reason": "canary_mismatch", "detail": "the adapter answers 0.42 nats/token "
               "from the version's canary", "failures": 1, "retry_in_s": 29.0}
    registry.report_engine(gateway, [{"index": 0, "url": "http://vllm-0.vllm:8000", "kind": "remote", "healthy": True,
                                      "restarts": 0, "in_flight": 0, "resident": ["beta@v1"], "refused": [refused],
                                      "load_failures": {"canary_mismatch": 1}}], stale_s=60)
    gateways = httpx.get(f"{console.url}/api/engine", headers=admin(console)).json()["gateways"]
    reports = {g["gateway"]: g for g in gateways}
    assert reports[gateway]["replicas"][0]["refused"] == [refused]
    registry.report_engine(gateway + "-other", [], stale_s=-1)      # every report is stale now: forgotten
    assert gateway not in {g["gateway"] for g in
                           httpx.get(f"{console.url}/api/engine", headers=admin(console)).json()["gateways"]}


# --- deleting a tenant ------------------------------------------------------------------------

@pytest.fixture
def deleting_console(stack, tmp_path):
    """The control API as `build` wires it: with the adapter store and the learner's checkpoints
    (local, under tmp_path) that a deletion empties."""
    import uuid

    import redis

    from clora.checkpoint_storage import LocalCheckpoints
    from clora.infra.control import create_control_app
    from clora.ingest.buffers import ReplayBuffer
    from clora.registry import Registry
    from clora.storage import LocalStorage
    from tests.fakes import ServerThread

    client = redis.Redis.from_url(stack.redis_url)
    from clora.trainapi.weights import CheckpointDir

    storage, checkpoints = LocalStorage(tmp_path / "adapters"), LocalCheckpoints(tmp_path / "checkpoints")
    saved = CheckpointDir(tmp_path / "tinker-weights")
    token = "test-admin-" + uuid.uuid4().hex
    app = create_control_app(Registry(client), ReplayBuffer(client), token, storage=storage, checkpoints=checkpoints,
                             tinker_weights=saved)
    with ServerThread(app, lifespan="auto") as server:
        server.token, server.storage, server.checkpoints, server.saved = token, storage, checkpoints, saved
        yield server


def _tinker_run(server, redis_client, tenant: str, tmp_path) -> dict:
    """A Tinker run of `tenant` as the training API and the learner leave it: its session, run
    record, seq_id order, finished count, a queued and a finished request, a sampling session and
    its answer, the run's state checkpoint and a saved sampler checkpoint; returns its keys."""
    import json
    import uuid

    from clora.trainapi import queue
    from clora.trainapi.runs import seq_key, session_key
    from clora.trainapi.sampling import ASAMPLE_KEY, SESSION_KEY
    from clora.trainapi.weights import CheckpointInfo, TinkerPath

    sid = uuid.uuid4().hex
    model_id = f"{sid}:train:0"
    run = f"{tenant}/tinker/{model_id}"
    queued, finished = f"req-{uuid.uuid4().hex}", f"req-{uuid.uuid4().hex}"
    keys = {"session": session_key(sid), "seq": seq_key(run), "queue": queue.queue_key(run),
            "meta": queue.run_meta_key(run), "queued": queue.request_key(queued),
            "finished": queue.request_key(finished), "sampling": f"{SESSION_KEY}{sid}:sample:0",
            "answer": f"{ASAMPLE_KEY}{sid}:sample:0:1"}
    redis_client.set(keys["session"], json.dumps({"session_id": sid, "tenant": tenant}))
    redis_client.hset(queue.RUNS, run, json.dumps({"tenant": tenant, "model_id": model_id, "seed": 0,
                                                   "session_id": sid}))
    redis_client.hset(keys["seq"], mapping={"0": json.dumps({"request_id": queued}), "next": 1})
    redis_client.hset(keys["meta"], "done", 1)
    redis_client.hset(keys["queued"], mapping={"tenant": tenant, "model_id": model_id, "op": "optim_step",
                                               "state": "pending"})
    redis_client.rpush(keys["queue"], queued)
    redis_client.hset(keys["finished"], mapping={"tenant": tenant, "model_id": model_id, "state": "done"})
    redis_client.set(keys["sampling"], json.dumps({"tenant": tenant, "served_model": f"{tenant}@v1",
                                                   "model_path": None}))
    redis_client.set(keys["answer"], "{}")
    state = tmp_path / f"state-{sid}.safetensors"
    state.write_bytes(b"x")
    server.checkpoints.put(queue.run_checkpoint_name(run), 1, state)
    path = TinkerPath(model_id, "sampler_weights", "final")

    def fill(folder):
        (folder / "adapter_config.json").write_text("{}")
        return CheckpointInfo(path=str(path), tenant=tenant, base_model="tiny", lora_rank=4, train_attn=True,
                              train_mlp=True, step=1, has_optimizer=False, created_at=1.0)

    server.saved.write(tenant, path, False, fill)
    return {"keys": keys, "run": run, "checkpoint": queue.run_checkpoint_name(run), "saved": path}


def _tenant_with_everything(server, registry, redis_client, tenant_id, tmp_path) -> dict:
    """A tenant with an API key, a Tinker key, a buffer, a live published version (its folder in
    the store) and a learner checkpoint; returns its keys."""
    from clora.ingest.buffers import PendingWrite, ReplayBuffer

    _, key = registry.create_tenant(tenant_id)
    tinker = registry.create_tinker_key(tenant_id)
    ReplayBuffer(redis_client).add_many(tenant_id, [PendingWrite("fb1", [], "", untrained="unknown_key")], now=1.0)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "adapter_config.json").write_text("{}")
    (server.storage.root / tenant_id).mkdir(parents=True)
    uri = server.storage.publish(tenant_id, 1, staged)
    registry.record_adapter_version(tenant_id, AdapterVersion(version=1, path=uri, base_model="tiny"))
    registry.set_live_version(tenant_id, 1)
    registry.append_metrics(tenant_id, {"step": 1, "loss": 0.5})
    (tmp_path / "ckpt.safetensors").write_bytes(b"x")
    server.checkpoints.put(f"tenants/{tenant_id}", 1, tmp_path / "ckpt.safetensors")
    return {"api": key, "tinker": tinker, "run": _tinker_run(server, redis_client, tenant_id, tmp_path)}


def _assert_run_is(server, redis_client, tenant: str, run: dict, there: bool) -> None:
    from clora.trainapi import queue

    assert [redis_client.exists(k) for k in run["keys"].values()] == [int(there)] * len(run["keys"]), run["keys"]
    assert redis_client.hexists(queue.RUNS, run["run"]) == there
    assert bool(server.checkpoints.entries(run["checkpoint"])) == there
    assert server.saved.exists(tenant, run["saved"]) == there


def _assert_gone(server, registry, redis_client, tenant_id, keys) -> None:
    from clora.registry import TenantNotFound

    assert registry.authenticate(keys["api"]) is None and registry.authenticate_tinker(keys["tinker"]) is None
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id, retired=True)
    assert tenant_id not in [t.id for t in registry.list_tenants()]
    tombstone = registry.tombstone_key(tenant_id)        # no data: it keeps late events from storing any
    assert redis_client.keys(f"clora:t:{{{tenant_id}}}:*") == [tombstone.encode()]   # replay buffers
    assert 0 < redis_client.ttl(tombstone)
    assert redis_client.keys(f"clora:tenant:{tenant_id}*") == []            # record, keys, versions, metrics
    assert not (server.storage.root / tenant_id).exists()                   # adapter folders
    assert server.checkpoints.entries(f"tenants/{tenant_id}") == []
    _assert_run_is(server, redis_client, tenant_id, keys["run"], there=False)     # its Tinker runs
    assert not (server.saved.root / tenant_id).exists()


def test_delete_removes_a_tenant_and_everything_it_owns(deleting_console, registry, redis_client, tenant_id,
                                                        tmp_path):
    keys = _tenant_with_everything(deleting_console, registry, redis_client, tenant_id, tmp_path)
    assert registry.authenticate(keys["api"]).tenant == tenant_id and redis_client.keys(f"clora:t:{{{tenant_id}}}:*")
    _assert_run_is(deleting_console, redis_client, tenant_id, keys["run"], there=True)
    other = "o" + tenant_id[1:]          # another tenant's Tinker run: left alone
    registry.create_tenant(other)
    others = _tinker_run(deleting_console, redis_client, other, tmp_path)
    url = f"{deleting_console.url}/api/tenants/{tenant_id}"
    r = httpx.delete(url, headers=admin(deleting_console))
    assert r.status_code == 200 and r.json() == {"deleted": tenant_id}
    _assert_gone(deleting_console, registry, redis_client, tenant_id, keys)
    _assert_run_is(deleting_console, redis_client, other, others, there=True)
    again = httpx.delete(url, headers=admin(deleting_console))
    assert again.status_code == 404 and again.json()["error"]["code"] == "tenant_not_found"
    assert httpx.get(url, headers=admin(deleting_console)).status_code == 404
    r = httpx.post(f"{deleting_console.url}/api/tenants", headers=admin(deleting_console), json={"id": tenant_id})
    assert r.status_code == 201   # the id is free again
    assert redis_client.keys(f"clora:t:{{{tenant_id}}}:*") == [], "a tenant taken again must store its events"


def test_delete_of_an_unknown_tenant_is_404(deleting_console, tenant_id):
    r = httpx.delete(f"{deleting_console.url}/api/tenants/{tenant_id}", headers=admin(deleting_console))
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"


def test_a_delete_interrupted_after_retiring_leaves_nothing_serving_and_a_retry_finishes(
        deleting_console, registry, redis_client, tenant_id, tmp_path):
    from clora.registry import TenantNotFound

    keys = _tenant_with_everything(deleting_console, registry, redis_client, tenant_id, tmp_path)
    registry.retire_tenant(tenant_id)   # where a crash after step 1 leaves it
    assert registry.authenticate(keys["api"]) is None and registry.authenticate_tinker(keys["tinker"]) is None
    assert registry.live_version(tenant_id) is None                     # the gateways' hot swap serves nothing
    assert tenant_id not in [t.id for t in registry.list_tenants()]     # no learner or gateway lists it
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id)
    url = f"{deleting_console.url}/api/tenants"
    taken = httpx.post(url, headers=admin(deleting_console), json={"id": tenant_id})
    assert taken.status_code == 409 and "being deleted" in taken.json()["error"]["message"]
    assert (deleting_console.storage.root / tenant_id / "v1").is_dir()  # its data is still there
    r = httpx.delete(f"{url}/{tenant_id}", headers=admin(deleting_console))
    assert r.status_code == 200
    _assert_gone(deleting_console, registry, redis_client, tenant_id, keys)

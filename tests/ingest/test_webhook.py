"""The feedback webhook over real HTTP, with the real broker, Redis and an ingest worker:
accepted feedback lands in the tenant's buffer, every bad request gets the right 4xx naming
the problem, and a stopped broker gives 503s without losing anything answered 202."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time
import uuid

import httpx
import pytest

from clora.registry import sign
from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent

pytestmark = pytest.mark.integration


@pytest.fixture
def tenant(registry, tenant_id):
    _, key = registry.create_tenant(tenant_id)
    return tenant_id, key


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def serve_interaction(stack, registry, tenant: str, iid: str, answer: str = "5") -> None:
    """What the gateway does for each completion: claim the id, log the interaction."""
    registry.claim_interaction(iid, tenant)
    ev = InteractionEvent(tenant=tenant, interaction_id=iid, messages=[{"role": "user", "content": "2+2?"}],
                          response={"role": "assistant", "content": answer}, completion_token_ids=[5],
                          completion_logprobs=[-0.7])
    producer = EventProducer(stack.kafka_bootstrap)
    producer.send_sync(TOPIC_INTERACTIONS, tenant, ev.model_dump_json())
    producer.close()


def depth(redis_client, tenant: str, kind: str) -> int:
    buf = ReplayBuffer(redis_client)
    return buf.depth(tenant, kind) + buf.depth(tenant, kind, heldout=True)


def test_feedback_becomes_training_examples(stack, registry, redis_client, webhook, ingest_worker, tenant, wait_for):
    tid, key = tenant
    serve_interaction(stack, registry, tid, "chatcmpl-a1")
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={
        "interaction_id": "chatcmpl-a1", "source": "operator", "score": 0.0,
        "correction": {"role": "assistant", "content": "4"}})
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1
    wait_for(lambda: depth(redis_client, tid, "sft") == 1 and depth(redis_client, tid, "preference") == 1
             and depth(redis_client, tid, "rl") == 1, what="sft + preference + rl examples")


def test_the_webhook_stamps_its_accept_time_and_the_examples_carry_it(stack, registry, redis_client, webhook,
                                                                       ingest_worker, tenant, wait_for):
    tid, key = tenant
    serve_interaction(stack, registry, tid, "chatcmpl-at1")
    before = time.time()
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={
        "interaction_id": "chatcmpl-at1", "source": "operator", "time": 1_000.0,   # the client's own claim
        "correction": {"role": "assistant", "content": "4"}})
    answered = time.time()
    assert r.status_code == 202, r.text
    buf = ReplayBuffer(redis_client)
    (sft,) = wait_for(lambda: buf.latest(tid, "sft") + buf.heldout(tid, "sft"), what="the correction's SFT example")
    assert before <= sft.accepted_at <= answered and sft.time == 1_000.0


def test_feedback_before_interaction_is_joined(stack, registry, redis_client, webhook, ingest_worker, tenant, wait_for):
    tid, key = tenant
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key),
                   json={"interaction_id": "chatcmpl-early", "score": 1.0, "source": "environment"})
    assert r.status_code == 202
    time.sleep(1.0)
    assert depth(redis_client, tid, "rl") == 0      # parked, waiting for its interaction
    serve_interaction(stack, registry, tid, "chatcmpl-early")
    wait_for(lambda: depth(redis_client, tid, "rl") == 1, what="parked feedback joined")


def test_batch_and_idempotent_retry(webhook, redis_client, ingest_worker, stack, registry, tenant, wait_for):
    tid, key = tenant
    for i in range(5):
        serve_interaction(stack, registry, tid, f"b{i}")
    records = [{"interaction_id": f"b{i}", "event_id": f"{tid}-e{i}", "score": 1.0} for i in range(5)]
    for _ in range(3):                                # a client retrying the same batch
        r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(key), json={"records": records})
        assert r.status_code == 202 and r.json()["event_ids"] == [x["event_id"] for x in records]
    wait_for(lambda: depth(redis_client, tid, "rl") == 5, what="5 rl examples")
    # the other two copies may come in a later fetch: wait for them to be counted, not a fixed time
    wait_for(lambda: ReplayBuffer(redis_client).stats(tid).get("duplicates") == 10, what="10 duplicates counted")
    assert depth(redis_client, tid, "rl") == 5


def test_scores_the_reward_spec_does_not_take_are_stored_and_counted_not_trained(
        stack, registry, redis_client, webhook, ingest_worker, tenant, wait_for):
    from prometheus_client import REGISTRY

    from clora.ingest.worker import POLICY_CACHE_S

    tid, key = tenant
    registry.update_policy(tid, reward_spec={"keys": {
        "thumbs": {"type": "bool", "sources": ["user"]},
        "stars": {"type": "scale", "lo": 1, "hi": 5, "weight": 0.5, "sources": ["user"]}}})
    counted = lambda why: REGISTRY.get_sample_value("clora_feedback_untrained_total", {"reason": why}) or 0.0
    before = {why: counted(why) for why in ("unknown_key", "untrusted_source", "out_of_range")}
    iid = [f"{tid}-s{i}" for i in range(6)]
    for i in iid:
        serve_interaction(stack, registry, tid, i)
    records = [{"interaction_id": iid[0], "key": "stars", "score": 4, "source": "user"},          # trains
               {"interaction_id": iid[1], "key": "helpfulness", "score": 1, "source": "user"},    # unknown key
               {"interaction_id": iid[2], "score": 1.0, "source": "environment"},                 # no key: "score"
               {"interaction_id": iid[3], "key": "thumbs", "score": 1, "source": "judge"},        # untrusted
               {"interaction_id": iid[4], "key": "stars", "score": 7, "source": "user"},          # out of range
               {"interaction_id": iid[5], "key": "helpfulness", "score": 1, "source": "user",     # correction still
                "correction": {"role": "assistant", "content": "4"}}]                             # trains
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(key), json={"records": records})
    assert r.status_code == 202, r.text
    buf = ReplayBuffer(redis_client)
    wait_for(lambda: buf.untrained_feedback(tid) == {"unknown_key": 3, "untrusted_source": 1, "out_of_range": 1},
             what="untrained feedback counted by reason")
    wait_for(lambda: depth(redis_client, tid, "sft") == 1, what="the correction's sft example")
    (rl,) = buf.latest(tid, "rl") + buf.heldout(tid, "rl")
    assert (rl.interaction_id, rl.reward, rl.weight) == (iid[0], 0.75, 0.5)
    assert sorted(f["interaction_id"] for f in buf.recent_feedback(tid)) == sorted(iid)   # every one is listed
    assert counted("unknown_key") - before["unknown_key"] >= 3
    assert counted("untrusted_source") > before["untrusted_source"] and counted("out_of_range") > before["out_of_range"]

    # an edit of the spec applies within the worker's cache time
    registry.update_policy(tid, reward_spec={"keys": {"helpfulness": {"type": "bool", "sources": ["user"]}}})
    time.sleep(POLICY_CACHE_S + 0.5)
    serve_interaction(stack, registry, tid, f"{tid}-s6")
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key),
                   json={"interaction_id": f"{tid}-s6", "key": "helpfulness", "score": 1, "source": "user"})
    assert r.status_code == 202
    wait_for(lambda: depth(redis_client, tid, "rl") == 2, what="a score of the newly named key trained")
    assert buf.untrained_feedback(tid)["unknown_key"] == 3


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer clk_nope_nope"}, {"X-API-Key": "garbage"}])
def test_missing_or_bad_key_is_401(webhook, headers):
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=headers, json={"interaction_id": "x", "score": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")


def test_revoked_key_is_401(webhook, registry, tenant):
    tid, key = tenant
    registry.revoke_key(tid, registry.authenticate(key).key_id)
    time.sleep(webhook.settings.auth_cache_s + 0.1)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": "x", "score": 1})
    assert r.status_code == 401


def test_feedback_on_another_tenants_interaction_is_403(webhook, registry, tenant, tenant_id):
    tid, key = tenant
    other = tid + "-b"
    registry.create_tenant(other)
    registry.claim_interaction("chatcmpl-of-b", other)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": "chatcmpl-of-b", "score": 1})
    assert r.status_code == 403 and r.json()["error"]["field"] == "interaction_id"


@pytest.mark.parametrize("body, field", [
    ({"interaction_id": "x", "score": "high"}, "score"),
    ({"score": 1}, "interaction_id"),
    ({"interaction_id": "x", "source": "robot", "score": 1}, "source"),
    ({"interaction_id": "x", "correction": {"role": "assistant"}}, "correction"),
])
def test_invalid_record_is_422_naming_the_field(webhook, tenant, body, field):
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(tenant[1]), json=body)
    assert r.status_code == 422
    assert r.json()["error"]["field"].startswith(field), r.json()


def test_invalid_batch_record_names_its_index(webhook, tenant):
    recs = [{"interaction_id": "x", "score": 1}] * 3 + [{"interaction_id": "x", "score": "high"}]
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(tenant[1]), json={"records": recs})
    assert r.status_code == 422 and r.json()["error"]["field"] == "records.3.score"


def test_too_large_is_413(webhook, tenant):
    big = {"interaction_id": "x", "comment": "x" * 9000}
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(tenant[1]), json={"records": [big] * 10})
    assert r.status_code == 413
    many = [{"interaction_id": "x", "score": 1}] * (webhook.settings.max_batch + 1)
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(tenant[1]), json={"records": many})
    assert r.status_code == 413 and r.json()["error"]["field"] == "records"


def test_hmac_signed_requests(webhook, registry, tenant):
    tid, key = tenant
    registry.set_signing_secret(tid, "s3cret")
    time.sleep(webhook.settings.auth_cache_s + 0.1)
    body = json.dumps({"interaction_id": "x", "score": 1}).encode()

    def post(ts: str, sig: str | None):
        headers = {**auth(key), "content-type": "application/json", "X-Clora-Timestamp": ts}
        if sig is not None:
            headers["X-Clora-Signature"] = sig
        return httpx.post(f"{webhook.url}/v1/feedback", headers=headers, content=body)

    now = str(int(time.time()))
    assert post(now, "sha256=" + sign("s3cret", now, body)).status_code == 202
    assert post(now, None).json()["error"]["code"] == "signature_required"
    assert post(now, "sha256=" + sign("wrong", now, body)).json()["error"]["code"] == "bad_signature"
    old = str(int(time.time()) - 3600)
    r = post(old, "sha256=" + sign("s3cret", old, body))
    assert r.status_code == 401 and r.json()["error"]["code"] == "stale_signature"


def test_openapi_spec_validates(webhook):
    from openapi_spec_validator import validate

    spec = httpx.get(f"{webhook.url}/openapi.json").json()
    validate(spec)
    assert {"/v1/feedback", "/v1/feedback/batch"} <= set(spec["paths"])


def test_stopped_broker_gives_503_and_loses_nothing_accepted(stack, registry, redis_client, webhook, ingest_worker,
                                                            tenant, wait_for):
    """Concurrent clients stream feedback; the broker freezes mid-stream (SIGSTOP: the
    embedded Tansu keeps its log in memory, so freezing is how it becomes unavailable
    without losing what it already holds). Every 202 must end up in the buffer."""
    tid, key = tenant
    broker = stack.processes["broker"]
    accepted: set[str] = set()
    statuses: list[int] = []

    done = threading.Event()

    def client(most: int) -> None:
        with httpx.Client(timeout=10) as c:
            for _ in range(most):  # until the test has seen the broker stop and come back
                if done.is_set():
                    return
                eid = f"{tid}-{uuid.uuid4().hex[:8]}"
                r = c.post(f"{webhook.url}/v1/feedback", headers=auth(key),
                           json={"interaction_id": f"s-{eid}", "event_id": eid, "score": 1.0})
                statuses.append(r.status_code)
                if r.status_code == 202:
                    accepted.add(eid)
                else:
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text

    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client, 2000) for _ in range(4)]
        try:
            wait_for(lambda: 202 in statuses, timeout=15, what="feedback accepted before the broker stops")
            broker.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                wait_for(lambda: 503 in statuses, timeout=15, what="a 503 while the broker is stopped")
                assert time.monotonic() - t0 < 10
            finally:
                broker.signal(signal.SIGCONT)
            after = len(statuses)
            wait_for(lambda: statuses[after:].count(202) >= 8, timeout=30, what="feedback accepted again")
        finally:
            done.set()
        for f in futs:
            f.result()
    assert 503 in statuses and 202 in statuses
    # a retry after the broker is back succeeds
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": "after", "score": 1})
    assert r.status_code == 202
    # feedback without a served interaction is parked: count it in the tenant's dedup set
    seen = lambda: {m.decode() for m in redis_client.zrange(f"clora:t:{{{tid}}}:seen", 0, -1)}
    wait_for(lambda: accepted <= seen(), timeout=60, what="every accepted event stored")


def test_redis_restart_costs_no_request_and_redis_down_is_503(stack, webhook, tenant, wait_for):
    """The webhook's Redis connections survive a Redis restart; while Redis is down it answers
    503 (retry), never 500."""
    tid, key = tenant
    redis_proc = stack.processes["redis"]
    body = {"interaction_id": f"{tid}-r", "score": 1.0}
    assert httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json=body).status_code == 202
    redis_proc.kill()
    try:
        time.sleep(webhook.settings.auth_cache_s + 0.1)
        r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable", r.text
    finally:
        redis_proc.start()
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json=body, timeout=30)
    assert r.status_code == 202, r.text


def post_raw(webhook, key: str, body: bytes, path: str = "/v1/feedback", **headers: str) -> httpx.Response:
    """POST `body` as JSON; `headers` go as UTF-8 bytes, as a client may send any byte."""
    return httpx.post(f"{webhook.url}{path}", content=body, headers={
        **auth(key), "content-type": "application/json", **{k: v.encode() for k, v in headers.items()}})


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_time_or_score_is_422_naming_it(webhook, tenant, value):
    """Python's json reads NaN and Infinity; the door refuses them rather than the worker later."""
    for field in ("time", "score"):
        body = f'{{"interaction_id": "x", "score": 1, "{field}": {value}}}'.encode()
        r = post_raw(webhook, tenant[1], body)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    r = post_raw(webhook, tenant[1], f'{{"records": [{{"interaction_id": "x", "score": 1, "time": {value}}}]}}'.encode(),
                 "/v1/feedback/batch")
    assert r.status_code == 422 and r.json()["error"]["field"] == "records.0.time", r.text


@pytest.mark.parametrize("path, wrap, field", [
    ("/v1/feedback", lambda deep: {"interaction_id": "x", "score": 1, "comment": deep}, "comment.0.0"),
    ("/v1/feedback/batch", lambda deep: {"records": [{"interaction_id": "x", "correction": deep}]},
     "records.0.correction.0"),
])
def test_a_body_nested_past_what_parsers_downstream_accept_is_422_naming_where(webhook, tenant, path, wrap, field):
    from clora.web import MAX_JSON_DEPTH

    deep = json.dumps(wrap("__deep__")).replace('"__deep__"', "[" * 20_000 + "]" * 20_000).encode()
    r = post_raw(webhook, tenant[1], deep, path)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "too_deeply_nested" and r.json()["error"]["field"].startswith(field)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]


def test_correction_arguments_nested_too_deep_are_422_naming_the_field(webhook, tenant):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 20_000 + "]" * 20_000}}
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(tenant[1]), json={
        "interaction_id": "x", "correction": {"role": "assistant", "content": None, "tool_calls": [call]}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "correction.tool_calls.0.function.arguments"


def _signed(webhook, registry, tenant) -> tuple[str, str]:
    tid, key = tenant
    registry.set_signing_secret(tid, "s3cret")
    time.sleep(webhook.settings.auth_cache_s + 0.1)
    return tid, key


@pytest.mark.parametrize("ts, sig, header", [
    ("now", "sha256=\u00e9" + "0" * 63, "X-Clora-Signature"),   # not ASCII: compared as bytes after the format check
    ("now", "sha256=" + "0" * 63, "X-Clora-Signature"),
    ("now", "md5=" + "0" * 64, "X-Clora-Signature"),
    ("nan", "good", "X-Clora-Timestamp"),     # float("nan") is no age: it passed every window
    ("inf", "good", "X-Clora-Timestamp"),
    ("1e9", "good", "X-Clora-Timestamp"),
    ("\u0661\u0662", "good", "X-Clora-Timestamp"),   # Arabic-Indic digits that float() reads
])
def test_a_malformed_signature_or_timestamp_is_401_naming_the_header(webhook, registry, tenant, ts, sig, header):
    _, key = _signed(webhook, registry, tenant)
    body = json.dumps({"interaction_id": "x", "score": 1}).encode()
    ts = str(int(time.time())) if ts == "now" else ts
    sig = "sha256=" + sign("s3cret", ts, body) if sig == "good" else sig
    r = post_raw(webhook, key, body, **{"X-Clora-Timestamp": ts, "X-Clora-Signature": sig})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "bad_signature" and r.json()["error"]["field"] == header


def test_a_replayed_signed_request_without_event_ids_stores_nothing_new(webhook, registry, redis_client,
                                                                         ingest_worker, stack, tenant, wait_for):
    tid, key = _signed(webhook, registry, tenant)
    serve_interaction(stack, registry, tid, f"{tid}-i")
    body = json.dumps({"records": [{"interaction_id": f"{tid}-i", "score": 1.0}]}).encode()
    ts = str(int(time.time()))
    headers = {"X-Clora-Timestamp": ts, "X-Clora-Signature": "sha256=" + sign("s3cret", ts, body)}
    first = post_raw(webhook, key, body, "/v1/feedback/batch", **headers)
    replay = post_raw(webhook, key, body, "/v1/feedback/batch", **headers)
    assert first.status_code == replay.status_code == 202
    assert first.json()["event_ids"] == replay.json()["event_ids"]
    wait_for(lambda: ReplayBuffer(redis_client).stats(tid).get("duplicates") == 1, what="the replay counted a duplicate")
    assert depth(redis_client, tid, "rl") == 1
    later = str(int(time.time()) + 1)           # the same body signed anew is a new request
    again = post_raw(webhook, key, body, "/v1/feedback/batch",
                     **{"X-Clora-Timestamp": later, "X-Clora-Signature": "sha256=" + sign("s3cret", later, body)})
    assert again.status_code == 202 and again.json()["event_ids"] != first.json()["event_ids"]


def test_feedback_on_the_bare_id_of_an_n_choice_response_is_422_naming_the_ids_to_use(webhook, registry, tenant,
                                                                                      tenant_id):
    from clora.ids import new_response_id

    tid, key = tenant
    r3, r2 = new_response_id("chat"), new_response_id("responses")
    registry.claim_response(r3, tid, 3)                           # a gateway that records the count
    registry.claim_interaction(f"{r2}-0", tid)                    # one that records the choices only
    registry.claim_interaction(f"{r2}-1", tid)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": r3, "score": 1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "interaction_id"
    assert f"{r3}-0, {r3}-1, {r3}-2" in r.json()["error"]["message"]
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(key), json={"records": [
        {"interaction_id": f"{r3}-1", "score": 1}, {"interaction_id": r2, "score": 1}]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "records.1.interaction_id"
    assert f"{r2}-0, {r2}-1, ..." in r.json()["error"]["message"]
    ok = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": f"{r3}-2", "score": 1})
    assert ok.status_code == 202
    other = tid + "-b"
    _, other_key = registry.create_tenant(other)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(other_key), json={"interaction_id": r3, "score": 1})
    assert r.status_code == 403, r.text       # someone else's response: not even its shape is told
    # an id the gateway could not have minted is never looked up as a response: accepted as pending
    registry.claim_interaction(f"{tid}-mine-0", tid)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": f"{tid}-mine", "score": 1})
    assert r.status_code == 202, r.text


# --- feedback on interactions the gateway never served ------------------------------------------

def pending_count() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("clora_webhook_feedback_pending_total") or 0.0


def test_feedback_on_a_gateway_shaped_id_the_gateway_never_served_is_404_naming_the_field(webhook, registry, tenant):
    from clora.ids import new_response_id

    tid, key = tenant
    for kind in ("chat", "completion", "responses"):               # every route's ids
        never = new_response_id(kind)
        r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": never, "score": 1})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "interaction_not_found" and r.json()["error"]["field"] == "interaction_id"
        assert never in r.json()["error"]["message"]
    served = new_response_id("completion")
    registry.claim_response(served, tid, 2)                       # served with n=2: choices -0 and -1
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": f"{served}-2", "score": 1})
    assert r.status_code == 404 and r.json()["error"]["field"] == "interaction_id", r.text


def test_feedback_on_an_interaction_the_gateway_served_is_202_and_joins(stack, registry, redis_client, webhook,
                                                                         ingest_worker, tenant, wait_for):
    from clora.ids import new_response_id

    tid, key = tenant
    iid = new_response_id("chat")
    serve_interaction(stack, registry, tid, iid)
    before = pending_count()
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": iid, "score": 1.0})
    assert r.status_code == 202, r.text
    wait_for(lambda: depth(redis_client, tid, "rl") == 1, what="the feedback joined its interaction")
    assert pending_count() == before                              # the platform knew this one


def test_a_batch_with_one_never_served_gateway_id_is_404_naming_the_record_and_stores_nothing(
        stack, registry, redis_client, webhook, ingest_worker, tenant, wait_for):
    from clora.ids import new_response_id

    tid, key = tenant
    served = [new_response_id("chat") for _ in range(2)]
    for iid in served:
        serve_interaction(stack, registry, tid, iid)
    records = [{"interaction_id": served[0], "score": 1.0, "event_id": f"{tid}-ok-0"},
               {"interaction_id": new_response_id("chat"), "score": 1.0, "event_id": f"{tid}-bad"},
               {"interaction_id": served[1], "score": 1.0, "event_id": f"{tid}-ok-1"}]
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(key), json={"records": records})
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"code": "interaction_not_found", "field": "records.1.interaction_id",
                                 "message": r.json()["error"]["message"]}
    assert r.json()["error"]["message"].startswith("records.1.interaction_id: the gateway never served")
    # One more record on the same tenant's partition: once it is stored, anything the refused batch
    # had written before it would have been stored too.
    marker = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key),
                        json={"interaction_id": served[1], "score": 1.0, "event_id": f"{tid}-marker"})
    assert marker.status_code == 202, marker.text
    wait_for(lambda: depth(redis_client, tid, "rl") == 1, what="the marker's rl example")
    assert [f["event_id"] for f in ReplayBuffer(redis_client).recent_feedback(tid, 10)] == [f"{tid}-marker"]


def test_feedback_on_an_id_of_another_shape_is_accepted_as_pending_and_joins_when_recorded(
        stack, registry, redis_client, webhook, ingest_worker, tenant, wait_for):
    tid, key = tenant
    own = f"{tid}-my-app-7"                                        # a client that records interactions itself
    before = pending_count()
    r = httpx.post(f"{webhook.url}/v1/feedback", headers=auth(key), json={"interaction_id": own, "score": 1.0})
    assert r.status_code == 202, r.text
    assert pending_count() == before + 1
    ev = InteractionEvent(tenant=tid, interaction_id=own, messages=[{"role": "user", "content": "2+2?"}],
                          response={"role": "assistant", "content": "4"})
    producer = EventProducer(stack.kafka_bootstrap)               # recorded by the client, never claimed
    producer.send_sync(TOPIC_INTERACTIONS, tid, ev.model_dump_json())
    producer.close()
    wait_for(lambda: depth(redis_client, tid, "rl") == 1, what="the pending feedback joined")


def test_an_unknown_route_a_wrong_method_and_an_invalid_body_answer_the_webhooks_envelope(webhook, tenant):
    r = httpx.post(f"{webhook.url}/v1/feedbacks", headers=auth(tenant[1]), json={"interaction_id": "x"})
    assert r.status_code == 404 and r.json() == {"error": {
        "code": "not_found", "message": "POST /v1/feedbacks: no such route or file", "field": "path"}}
    r = httpx.get(f"{webhook.url}/v1/feedback", headers=auth(tenant[1]))
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed" and "detail" not in r.json()
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers=auth(tenant[1]), json={"records": "none"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "records" and "detail" not in r.json()

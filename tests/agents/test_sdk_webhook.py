"""The tenant SDK (`clora_client`) against the real webhook, broker, Redis and an ingest worker:
unsigned and signed feedback is accepted and becomes training examples, a resent batch (same
event ids) stores nothing twice, and the webhook's refusals arrive as the SDK's exceptions."""

from __future__ import annotations

import uuid

import pytest

from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent
from clora_client import AuthenticationError, FeedbackClient, FeedbackRejected, interaction_id

pytestmark = pytest.mark.integration


def serve(stack, registry, tenant: str, n: int) -> list[str]:
    """What the gateway does for `n` completions: claim each id for the tenant, log each."""
    ids = [f"sdk-{uuid.uuid4().hex[:12]}" for _ in range(n)]
    producer = EventProducer(stack.kafka_bootstrap)
    for iid in ids:
        registry.claim_interaction(iid, tenant)
        ev = InteractionEvent(tenant=tenant, interaction_id=iid, messages=[{"role": "user", "content": "2+2?"}],
                              response={"role": "assistant", "content": "5"}, completion_token_ids=[5],
                              completion_logprobs=[-0.7])
        producer.send_sync(TOPIC_INTERACTIONS, tenant, ev.model_dump_json())
    producer.close()
    return ids


def rl_depth(redis_client, tenant: str) -> int:
    buf = ReplayBuffer(redis_client)
    return buf.depth(tenant, "rl") + buf.depth(tenant, "rl", heldout=True)


def client(webhook, key: str, **kw) -> FeedbackClient:
    limits = dict(batch_size=webhook.settings.max_batch, max_body_bytes=webhook.settings.max_body_bytes,
                  max_attempts=2)
    return FeedbackClient(webhook.url, key, **{**limits, **kw})


def test_unsigned_feedback_is_accepted_and_a_resent_batch_is_stored_once(
        stack, registry, redis_client, webhook, ingest_worker, tenant_id, wait_for):
    _, key = registry.create_tenant(tenant_id)
    ids = serve(stack, registry, tenant_id, 4)
    batch = [{"interaction_id": i, "score": 1.0, "source": "environment", "event_id": f"{tenant_id}-e{n}"}
             for n, i in enumerate(ids[1:])]
    with client(webhook, key) as fb:
        one = fb.thumbs({"id": ids[0], "choices": [{"index": 0}]}, up=True)
        sent = fb.send_batch(batch)
        assert fb.send_batch(batch) == sent == [r["event_id"] for r in batch]   # a retry by the caller
    assert one.startswith("fb-")
    wait_for(lambda: rl_depth(redis_client, tenant_id) == 4, what="4 rl examples")
    wait_for(lambda: ReplayBuffer(redis_client).stats(tenant_id).get("duplicates") == 3, what="3 duplicates counted")
    assert rl_depth(redis_client, tenant_id) == 4


def test_signed_feedback_is_accepted(stack, registry, redis_client, webhook, ingest_worker, tenant_id, wait_for):
    _, key = registry.create_tenant(tenant_id, signing_secret="s3cret")
    ids = serve(stack, registry, tenant_id, 3)
    with client(webhook, key, signing_secret="s3cret") as fb:
        fb.reward(ids[0], 1.0)
        fb.send_batch([{"interaction_id": i, "score": 0.0, "source": "environment"} for i in ids[1:]])
    wait_for(lambda: rl_depth(redis_client, tenant_id) == 3, what="3 rl examples")


def test_a_bad_or_missing_signature_is_an_authentication_error(registry, webhook, tenant_id):
    _, key = registry.create_tenant(tenant_id, signing_secret="s3cret")
    with client(webhook, key, signing_secret="not-the-secret") as fb:
        with pytest.raises(AuthenticationError) as bad:
            fb.comment("sdk-anything", "hello")
    with client(webhook, key) as fb:
        with pytest.raises(AuthenticationError) as missing:
            fb.comment("sdk-anything", "hello")
    assert (bad.value.status, bad.value.code, bad.value.field) == (401, "bad_signature", "X-Clora-Signature")
    assert (missing.value.status, missing.value.code) == (401, "signature_required")
    assert len(bad.value.event_ids) == 1


def test_the_webhooks_refusals_arrive_as_the_sdks_exceptions(stack, registry, webhook, tenant_id):
    _, key = registry.create_tenant(tenant_id)
    other = f"{tenant_id}-o"
    registry.create_tenant(other)
    (theirs,) = serve(stack, registry, other, 1)
    with client(webhook, key) as fb:
        with pytest.raises(AuthenticationError) as forbidden:
            fb.send_batch([{"interaction_id": f"sdk-{uuid.uuid4().hex[:8]}", "score": 1},
                           {"interaction_id": theirs, "score": 1}])
    assert (forbidden.value.status, forbidden.value.code) == (403, "forbidden")
    assert forbidden.value.field == "records.1.interaction_id"
    assert forbidden.value.rejected_event_id == forbidden.value.event_ids[1]
    with client(webhook, key, batch_size=webhook.settings.max_batch + 1) as fb:
        with pytest.raises(FeedbackRejected) as too_many:
            fb.send_batch([{"interaction_id": "sdk-x", "score": 1}] * (webhook.settings.max_batch + 1))
    assert (too_many.value.status, too_many.value.code) == (413, "batch_too_large")
    assert not isinstance(too_many.value, AuthenticationError)


def test_interaction_ids_of_an_n_choice_response_name_each_choice():
    completion = {"id": "chatcmpl-n", "choices": [{"index": 0}, {"index": 1}]}
    assert [interaction_id(completion, i) for i in range(2)] == ["chatcmpl-n-0", "chatcmpl-n-1"]

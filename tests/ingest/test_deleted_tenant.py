"""A deleted tenant's events still in the topics (accepted before the delete, consumed after it)
bring none of its data back: the registry's retire leaves a tombstone in the tenant's buffer key
slot, the buffers' delete keeps it, and every write script stores nothing while it exists. Taking
the id again clears it. The worker runs in-process on consumer records (no broker needed)."""

from __future__ import annotations

import json
import time
from collections import namedtuple

import pytest

from clora.ingest.buffers import InteractionWrite, ParkResult, PendingWrite, ReplayBuffer, tkey
from clora.ingest.schemas import (TOPIC_FEEDBACK, TOPIC_INTERACTIONS, FeedbackEvent, FeedbackIn, InteractionEvent,
                                  Message, SFTExample)
from clora.ingest.settings import IngestSettings
from clora.ingest.worker import IngestWorker

pytestmark = pytest.mark.integration

Record = namedtuple("Record", "topic partition offset key value")


def records(tenant: str, n: int, first: int = 0) -> list[Record]:
    """n interactions, each with a score, the score of every other one before its interaction."""
    out = []
    for i in range(first, first + n):
        ix = InteractionEvent(tenant=tenant, interaction_id=f"i{i}", event_id=f"ix{i}",
                              messages=[{"role": "user", "content": f"q{i}"}],
                              response={"role": "assistant", "content": f"a{i}"})
        fb = FeedbackEvent.accept(tenant, FeedbackIn(interaction_id=f"i{i}", event_id=f"fb{i}", score=1.0))
        pair = [Record(TOPIC_INTERACTIONS, 0, 2 * i, tenant.encode(), ix.model_dump_json().encode()),
                Record(TOPIC_FEEDBACK, 0, 2 * i + 1, tenant.encode(), fb.model_dump_json().encode())]
        out += pair[::-1] if i % 2 else pair
    return out


def keys_of(client, tenant: str) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=tkey(tenant, "*"), count=1000)}


def delete(registry, buffers: ReplayBuffer, tenant: str) -> None:
    """The control API's DELETE, as far as Redis goes."""
    registry.retire_tenant(tenant)
    buffers.delete_tenant(tenant)
    registry.purge_tenant(tenant)
    registry.drop_tenant(tenant)


def test_a_deleted_tenants_late_events_store_nothing_and_its_id_taken_again_stores_again(
        stack, redis_client, registry, tenant_id):
    registry.create_tenant(tenant_id)
    worker = IngestWorker(IngestSettings(), "127.0.0.1:1", stack.redis_url)    # no broker call on this path
    buffers = worker.buffers
    worker.handle(records(tenant_id, 6))
    assert buffers.stats(tenant_id)["added"] == 6

    delete(registry, buffers, tenant_id)
    assert keys_of(redis_client, tenant_id) == {registry.tombstone_key(tenant_id)}
    worker._policies.clear()
    worker.handle(records(tenant_id, 6, first=100))        # accepted before the delete, consumed after
    assert keys_of(redis_client, tenant_id) == {registry.tombstone_key(tenant_id)}, "a deleted tenant's data came back"

    registry.create_tenant(tenant_id)                     # the id taken again: a new tenant
    assert keys_of(redis_client, tenant_id) == set()
    worker.handle(records(tenant_id, 4, first=200))
    assert buffers.stats(tenant_id)["added"] == 4


def test_every_write_script_stores_nothing_for_a_deleted_tenant(redis_client, registry, tenant_id):
    buffers = ReplayBuffer(redis_client)
    registry.create_tenant(tenant_id)
    delete(registry, buffers, tenant_id)
    now = time.time()
    ex = SFTExample(example_id="x1", tenant=tenant_id, interaction_id="i1", feedback_event_id="f1", time=now,
                    messages=[Message(role="user", content="hi")], target=Message(role="assistant", content="yo"))
    assert buffers.add_many(tenant_id, [PendingWrite("f1", [ex], json.dumps({"event_id": "f1"}))], now=now) == [0]
    assert buffers.park_feedback(tenant_id, "f2", "i2", "{}", now=now, recent="{}") == ParkResult.DUPLICATE
    assert buffers.store_interactions(tenant_id, [InteractionWrite("e1", "i1", "{}"), InteractionWrite("e2", "i2", "{}")],
                                      now=now) == [[], []]
    assert keys_of(redis_client, tenant_id) == {registry.tombstone_key(tenant_id)}
    assert 0 < redis_client.ttl(registry.tombstone_key(tenant_id))

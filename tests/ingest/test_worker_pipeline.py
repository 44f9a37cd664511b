"""The worker prepares a poll's writes (reads its scores' interactions, joins them, builds the
scripts' calls) while the poll before it is still being written. A score whose interaction
is in that earlier poll, or in its own, is read as missing; the park script then answers that
the interaction is stored, and the worker joins it again. Each score lands exactly once, and
none stays parked. The worker runs in-process on consumer records against the real Redis."""

from __future__ import annotations

from collections import namedtuple

import pytest

from clora.ingest.buffers import tkey
from clora.ingest.schemas import TOPIC_FEEDBACK, TOPIC_INTERACTIONS, FeedbackEvent, FeedbackIn, InteractionEvent
from clora.ingest.settings import IngestSettings
from clora.ingest.worker import IngestWorker

pytestmark = pytest.mark.integration

Record = namedtuple("Record", "topic partition offset key value")


def interaction(tenant: str, i: int) -> Record:
    ix = InteractionEvent(tenant=tenant, interaction_id=f"i{i}", event_id=f"ix{i}",
                          messages=[{"role": "user", "content": f"q{i}"}],
                          response={"role": "assistant", "content": f"a{i}"})
    return Record(TOPIC_INTERACTIONS, 0, i, tenant.encode(), ix.model_dump_json().encode())


def score(tenant: str, i: int) -> Record:
    fb = FeedbackEvent.accept(tenant, FeedbackIn(interaction_id=f"i{i}", event_id=f"fb{i}", score=0.5))
    return Record(TOPIC_FEEDBACK, 0, i, tenant.encode(), fb.model_dump_json().encode())


def test_scores_prepared_before_their_interactions_are_written_land_once(stack, redis_client, registry, tenant_id):
    registry.create_tenant(tenant_id)
    worker = IngestWorker(IngestSettings(), "127.0.0.1:1", stack.redis_url)   # no broker call on this path
    first = worker.prepare(worker.parse_all([interaction(tenant_id, i) for i in range(4)]))
    # the next poll: scores of the first poll's interactions, and an interaction with its score
    second = worker.prepare(worker.parse_all([score(tenant_id, i) for i in range(4)]
                                             + [interaction(tenant_id, 4), score(tenant_id, 4)]))
    assert len(second.parked) == 5 and not second.pending          # every read came before the writes
    worker.apply(first)
    worker.apply(second)

    buffers = worker.buffers
    assert buffers.stats(tenant_id)["added"] == 5
    assert buffers.depth(tenant_id, "rl") + buffers.depth(tenant_id, "rl", heldout=True) == 5
    assert not [k for k in redis_client.scan_iter(match=tkey(tenant_id, "pending", "*"))]   # nothing left parked
    assert [ex.reward for ex in buffers.sample(tenant_id, "rl", 10).examples] == [0.5] * buffers.depth(tenant_id, "rl")

    worker.apply(worker.prepare(worker.parse_all([score(tenant_id, i) for i in range(5)])))   # redelivered
    assert buffers.stats(tenant_id)["added"] == 5

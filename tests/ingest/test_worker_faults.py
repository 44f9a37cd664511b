"""Ingest workers under faults: kill -9 a worker process mid-stream and restart it — every
accepted event lands exactly once; invalid records go to the dead-letter topic with a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import redis

from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import EventProducer
from clora.ingest.reports import recent_dead_letters
from clora.ingest.schemas import (TOPIC_DLQ, TOPIC_FEEDBACK, TOPIC_INTERACTIONS, FeedbackEvent, FeedbackIn,
                                  InteractionEvent)
from tests.kafka_read import read_keyed

pytestmark = pytest.mark.integration


def worker_process(stack, redis_url: str, group: str, log_path) -> subprocess.Popen:
    env = {**os.environ, "CLORA_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "CLORA_REDIS_URL": redis_url,
           "CLORA_INGEST_GROUP_ID": group, "CLORA_INGEST_METRICS_PORT": "0",
           "CLORA_INGEST_MAX_POLL_RECORDS": "100", "CLORA_INGEST_BUFFER_CAPACITY": "100000"}
    return subprocess.Popen([sys.executable, "-m", "clora.infra.cli", "ingest-worker", "--log-level", "WARNING"],
                            env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def stream(stack, tenant: str, n: int) -> None:
    """n interactions, each with one reward; half the feedback sent before its interaction."""
    producer = EventProducer(stack.kafka_bootstrap, timeout_s=30)
    for i in range(n):
        ix = InteractionEvent(tenant=tenant, interaction_id=f"i{i}", event_id=f"ix{i}",
                              messages=[{"role": "user", "content": f"q{i}"}],
                              response={"role": "assistant", "content": f"a{i}"})
        fb = FeedbackEvent.accept(tenant, FeedbackIn(interaction_id=f"i{i}", event_id=f"fb{i}", score=i % 2))
        first, second = ((TOPIC_FEEDBACK, fb), (TOPIC_INTERACTIONS, ix)) if i % 2 else ((TOPIC_INTERACTIONS, ix), (TOPIC_FEEDBACK, fb))
        producer.send(first[0], tenant, first[1].model_dump_json())
        producer.send(second[0], tenant, second[1].model_dump_json())
    producer.flush(60)
    producer.close()


@pytest.mark.slow
def test_kill_9_worker_mid_stream_stores_every_event_once(stack, tenant_id, tmp_path, wait_for):
    n = 3000
    redis_url = stack.redis_url.rsplit("/", 1)[0] + "/3"     # a db of its own: only this test's workers write it
    client = redis.Redis.from_url(redis_url)
    buf = ReplayBuffer(client)
    stored = lambda: buf.depth(tenant_id, "rl") + buf.depth(tenant_id, "rl", heldout=True)
    group = f"kill-{uuid.uuid4().hex[:6]}"

    stream(stack, tenant_id, n)                   # every event acknowledged (acks=all) before we start
    proc = worker_process(stack, redis_url, group, tmp_path / "w1.log")
    try:
        wait_for(lambda: stored() >= 300, timeout=60, interval=0.02, what="the first worker to store some examples")
        proc.kill()                                 # SIGKILL mid-stream
        proc.wait(10)
        partial = stored()
        assert 0 < partial < n, f"kill landed at {partial} of {n}: not mid-stream"
        proc = worker_process(stack, redis_url, group, tmp_path / "w2.log")
        wait_for(lambda: stored() == n, timeout=120, what=f"all {n} examples after restart")
        time.sleep(2.0)                             # nothing more trickles in
        assert stored() == n
        stats = buf.stats(tenant_id)
        assert stats["added"] == n
        ids = {e.feedback_event_id for e in buf.latest(tenant_id, "rl", n) + buf.heldout(tenant_id, "rl")}
        assert ids == {f"fb{i}" for i in range(n)}
    finally:
        proc.kill()
        proc.wait(10)


def test_invalid_records_go_to_the_dead_letter_topic(stack, ingest_worker, redis_client, tenant_id, wait_for):
    producer = EventProducer(stack.kafka_bootstrap)
    producer.send_sync(TOPIC_FEEDBACK, tenant_id, b"{not json")
    producer.send_sync(TOPIC_FEEDBACK, tenant_id, json.dumps({"type": "feedback", "tenant": tenant_id}))
    ok = FeedbackEvent.accept("someone-else", FeedbackIn(interaction_id="x", score=1))
    producer.send_sync(TOPIC_FEEDBACK, tenant_id, ok.model_dump_json())      # key/tenant mismatch
    producer.close()

    def mine():
        return [d for d in recent_dead_letters(redis_client, 200) if d.key == tenant_id]

    letters = wait_for(lambda: len(mine()) >= 3 and mine(), what="3 dead letters")
    reasons = " | ".join(d.reason for d in letters)
    assert "invalid FeedbackEvent" in reasons and "event_id" in reasons and "does not match tenant" in reasons

    on_topic = [json.loads(v) for v in read_keyed(stack.kafka_bootstrap, TOPIC_DLQ, tenant_id, lambda vs: len(vs) >= 3)]
    assert len(on_topic) == 3 and {d["source_topic"] for d in on_topic} == {TOPIC_FEEDBACK}

"""`clora up` supervises everything it starts, with real processes: a hung (SIGSTOPped) ingest
worker is killed and restarted while the group's lag, measured from the broker, shows the
backlog; a killed Redis comes back with its data; a killed broker comes back, its topics are
re-created and the loss is announced (ERROR log, a `data_lost` event in Redis)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import redis
from kafka import KafkaAdminClient

from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import EventProducer
from clora.ingest.settings import IngestSettings
from clora.ingest.reports import consumer_lag, recent_service_events
from clora.ingest.schemas import ALL_TOPICS, TOPIC_FEEDBACK, FeedbackEvent, FeedbackIn
from tests.infra.harness import FAST, pids_alive, running_platform, send_interactions

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    with running_platform(tmp_path_factory.mktemp("supervised"), ["ingest"]) as p:
        yield p


@pytest.fixture(scope="module")
def client(platform):
    c = redis.Redis.from_url(platform.stack.redis_url)
    yield c
    c.close()


def send_pairs(platform, tenant: str, ids: range) -> None:
    send_interactions(platform.stack.kafka_bootstrap, tenant, ids)
    producer = EventProducer(platform.stack.kafka_bootstrap, timeout_s=30)
    for i in ids:
        fb = FeedbackEvent.accept(tenant, FeedbackIn(interaction_id=f"i{i}", event_id=f"fb{i}", score=1.0))
        producer.send(TOPIC_FEEDBACK, tenant, fb.model_dump_json())
    producer.flush(60)
    producer.close()


def stored(client, tenant: str) -> int:
    buf = ReplayBuffer(client)
    return buf.depth(tenant, "rl") + buf.depth(tenant, "rl", heldout=True)


def events_of(client, service: str) -> list[str]:
    return [e.kind for e in recent_service_events(client) if e.service == service]


def test_a_hung_ingest_worker_is_restarted_and_its_backlog_shows_as_lag(platform, client, tenant_id, wait_for):
    worker = platform.services["ingest-0"]
    group = IngestSettings().group_id                   # the harness's, from the environment
    send_pairs(platform, tenant_id, range(0, 50))
    wait_for(lambda: stored(client, tenant_id) == 50, timeout=90, what="the first 50 examples")
    hung = worker.pid
    worker.signal(signal.SIGSTOP)                 # alive, but its loop makes no progress: a hang
    send_pairs(platform, tenant_id, range(50, 250))
    # the lag comes from the broker, not from the (frozen) worker's own loop
    wait_for(lambda: (consumer_lag(client, group) or 0) >= 400, timeout=30, what="the backlog as lag")
    wait_for(lambda: worker.restarts >= 1 and worker.alive(), timeout=60, what="the hung worker's restart")
    assert pids_alive(hung) == [] and worker.pid != hung
    wait_for(lambda: stored(client, tenant_id) == 250, timeout=120, what="all 250 examples after the restart")
    wait_for(lambda: consumer_lag(client, group) == 0, timeout=30, what="the lag back to 0")
    assert events_of(client, "ingest-0")[-2:] == ["restarted", "unresponsive"]   # newest first


def test_a_killed_redis_is_restarted_with_its_data(platform, client, wait_for):
    proc = platform.stack.processes["redis"]
    client.set("supervision-probe", "kept")
    proc.signal(signal.SIGKILL)
    wait_for(lambda: proc.restarts == 1 and proc.alive(), timeout=60, what="Redis's restart")
    wait_for(lambda: _ping(client), timeout=30, what="Redis answering")
    assert client.get("supervision-probe") == b"kept"            # AOF, appendfsync always
    # newest first; the supervisor notices the death by the exit, or, when its liveness probe was
    # already late on a loaded machine, by the silence (then it kills and restarts it as hung)
    wait_for(lambda: events_of(client, "redis")[:2] in (["restarted", "exited"], ["restarted", "unresponsive"]),
             what="Redis's events")


def test_a_killed_broker_is_restarted_its_topics_recreated_and_the_loss_announced(
        platform, client, tenant_id, wait_for, caplog):
    proc = platform.stack.processes["broker"]
    with caplog.at_level(logging.ERROR):
        proc.signal(signal.SIGKILL)
        wait_for(lambda: "data_lost" in events_of(client, "broker"), timeout=90, what="the data_lost event")
    assert proc.restarts == 1 and proc.alive()
    assert any("DATA LOSS" in r.getMessage() and "in memory" in r.getMessage() for r in caplog.records)
    admin = KafkaAdminClient(bootstrap_servers=platform.stack.kafka_bootstrap, request_timeout_ms=10_000)
    try:
        assert set(ALL_TOPICS) <= set(admin.list_topics())
    finally:
        admin.close()
    send_pairs(platform, tenant_id, range(0, 20))                 # ingest works on the new broker
    wait_for(lambda: stored(client, tenant_id) == 20, timeout=120, what="examples through the restarted broker")


def test_workers_that_beat_but_do_not_consume_are_restarted(tmp_path, tenant_id, wait_for):
    # heartbeats never time out here: only the group's committed offsets, read from the broker,
    # can tell that the frozen worker makes no progress
    patient = FAST.model_copy(update={"unresponsive_after_s": 600.0, "ingest_stalled_after_s": 15.0})
    with running_platform(tmp_path, ["ingest"], supervision=patient) as platform:
        client = redis.Redis.from_url(platform.stack.redis_url)
        worker = platform.services["ingest-0"]
        worker.signal(signal.SIGSTOP)
        send_pairs(platform, tenant_id, range(0, 30))
        wait_for(lambda: worker.restarts >= 1, timeout=60, what="the stalled worker's restart")
        wait_for(lambda: stored(client, tenant_id) == 30, timeout=120, what="all 30 examples after the restart")
        assert "stalled" in events_of(client, "ingest")
        assert "ingest stalled" in worker.events[0].detail
        client.close()


def _ping(client) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False

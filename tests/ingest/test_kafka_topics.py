"""`ensure_topics` and the Kafka clients: topics are created with the configured replication and
`min.insync.replicas` (what is asked of the broker, then against the suite's real broker, Tansu
over PLAINTEXT, which answers no topic configs), and a security combination that cannot work is
refused before any client connects."""

from __future__ import annotations

import time
import uuid

import pytest
from pydantic import ValidationError

from clora.ingest.producer import EventProducer, ensure_topics
from clora.ingest.reports import LagProbe
from clora.settings import KafkaSettings

class RecordingAdmin:
    """Stands in for `KafkaAdminClient`: records how it was built and what it was asked to create."""

    built: list[dict] = []
    created: list = []

    def __init__(self, **kwargs):
        RecordingAdmin.built.append(kwargs)

    def list_topics(self):
        return ["clora.feedback"]

    def create_topics(self, topics):
        RecordingAdmin.created.extend(topics)

    def close(self):
        pass


def test_missing_topics_are_asked_for_with_the_replication_and_min_insync_replicas(monkeypatch, tmp_path):
    import clora.ingest.producer as producer

    monkeypatch.setattr(RecordingAdmin, "built", [])
    monkeypatch.setattr(RecordingAdmin, "created", [])
    monkeypatch.setattr(producer, "KafkaAdminClient", RecordingAdmin)
    ca = tmp_path / "ca.pem"
    ca.write_text("ca")
    kafka = KafkaSettings(security_protocol="SSL", ssl_cafile=ca, replication_factor=3, min_insync_replicas=2)
    ensure_topics("kafka-0:9093", 6, ("clora.feedback", "clora.interactions"), kafka=kafka)
    assert RecordingAdmin.built == [{"bootstrap_servers": "kafka-0:9093", "request_timeout_ms": 10_000,
                                     "security_protocol": "SSL", "ssl_cafile": str(ca)}]
    [topic] = RecordingAdmin.created           # the existing one is left as it is
    assert (topic.name, topic.num_partitions, topic.replication_factor) == ("clora.interactions", 6, 3)
    assert topic.topic_configs == {"min.insync.replicas": "2"}


@pytest.mark.integration
def test_topics_are_created_with_the_replication_settings(stack):
    from kafka import KafkaAdminClient

    topic = f"clora.test.{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.kafka_bootstrap, 2, (topic,), kafka=KafkaSettings(replication_factor=1, min_insync_replicas=1))
    ensure_topics(stack.kafka_bootstrap, 2, (topic,), kafka=KafkaSettings())     # idempotent
    admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap, request_timeout_ms=10_000)
    try:
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    assert described["error_code"] == 0
    assert len(described["partitions"]) == 2
    assert all(p["replica_nodes"] == p["isr_nodes"] and len(p["replica_nodes"]) == 1 for p in described["partitions"])
    producer = EventProducer(stack.kafka_bootstrap, timeout_s=10.0)      # acks=all with one in-sync replica
    try:
        producer.send_sync(topic, "acme", "{}")
    finally:
        producer.close()


@pytest.mark.integration
@pytest.mark.parametrize("build", [
    lambda bootstrap: ensure_topics(bootstrap, 1, ("clora.test.never",)),
    lambda bootstrap: EventProducer(bootstrap),
    lambda bootstrap: LagProbe(bootstrap, "clora-test-never"),
], ids=["ensure_topics", "producer", "lag_probe"])
def test_sasl_without_credentials_is_refused_before_connecting(stack, monkeypatch, build):
    monkeypatch.setenv("CLORA_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("CLORA_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    started = time.monotonic()
    with pytest.raises(ValidationError, match="needs CLORA_KAFKA_SASL_USERNAME, CLORA_KAFKA_SASL_PASSWORD"):
        build(stack.kafka_bootstrap)
    assert time.monotonic() - started < 2.0      # no connection attempt, no timeout waited out

"""`EventProducer` (librdkafka) against the suite's real broker: keyed records land on the
partition kafka-python's partitioner gives them, a record too large is refused for good while
the rest are stored, and a broker that does not answer fails the write within its budget."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2

from clora.ingest.producer import BrokerUnavailable, EventProducer, RecordRefused, ensure_topics

pytestmark = pytest.mark.integration


def _read_all(bootstrap: str, topic: str, partitions: int, expected: int) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=10_000)
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        consumer.seek_to_beginning()
        got = []
        for record in consumer:               # stops after 10 s without a record (a hang bound)
            got.append(record)
            if len(got) == expected:
                break
        return got
    finally:
        consumer.close()


def test_keyed_records_land_where_kafka_pythons_partitioner_puts_them(stack):
    topic = f"clora.test.{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.kafka_bootstrap, 4, (topic,))
    keys = [f"tenant-{i}" for i in range(12)]
    producer = EventProducer(stack.kafka_bootstrap, timeout_s=10.0)
    try:
        asyncio.run(producer.send_many_and_wait(topic, [(k, f"v-{k}") for k in keys]))
    finally:
        producer.close()
    got = _read_all(stack.kafka_bootstrap, topic, 4, len(keys))
    assert sorted(r.key.decode() for r in got) == sorted(keys)
    placed = {r.key.decode(): r.partition for r in got}
    expected = {k: (murmur2(k.encode()) & 0x7FFFFFFF) % 4 for k in keys}
    assert placed == expected and len(set(placed.values())) > 1


def test_a_record_too_large_is_refused_for_good_and_the_next_is_stored(stack):
    topic = f"clora.test.{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.kafka_bootstrap, 1, (topic,))
    producer = EventProducer(stack.kafka_bootstrap, timeout_s=10.0)
    try:
        with pytest.raises(RecordRefused, match="MSG_SIZE_TOO_LARGE"):
            producer.send(topic, "acme", b"x" * 2_000_000)
        with pytest.raises(RecordRefused):
            asyncio.run(producer.send_many_and_wait(topic, [("acme", "small"), ("acme", b"x" * 2_000_000)]))
        producer.send_sync(topic, "acme", "after")
    finally:
        producer.close()
    values = [r.value for r in _read_all(stack.kafka_bootstrap, topic, 1, 2)]
    assert values[-1] == b"after" and b"x" * 2_000_000 not in values


def test_a_silent_broker_fails_the_write_within_its_budget_and_nothing_is_sent_later():
    with socket.socket() as silent:           # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        producer = EventProducer(bootstrap, timeout_s=1.0)
        try:
            # the wait's budget and librdkafka's own message timeout are the same 1 s: either may report it
            with pytest.raises(BrokerUnavailable, match="did not (acknowledge|store) 2 of 2 writes") as failed:
                asyncio.run(producer.send_many_and_wait("clora.feedback", [("a", "1"), ("b", "2")]))
            assert not isinstance(failed.value, RecordRefused)      # worth retrying: nothing wrong with the records
            with pytest.raises(BrokerUnavailable) as failed:
                producer.send_sync("clora.feedback", "a", "3")
            assert not isinstance(failed.value, RecordRefused)
            producer.flush(5.0)               # librdkafka gave every record up: none waits to be sent
        finally:
            producer.close()

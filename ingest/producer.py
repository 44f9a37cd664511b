"""Kafka producing for clora: topic creation and an acks=all producer whose writes can be
awaited from asyncio (the webhook answers 202 only after the broker acknowledged). Both connect
with the platform's Kafka client settings (`clora.settings.KafkaSettings`: TLS, SASL) and create
topics with its replication factor and `min.insync.replicas`.

    producer = EventProducer(bootstrap)
    await producer.send_many_and_wait(TOPIC_FEEDBACK, [(tenant, event.model_dump_json())])
"""

from __future__ import annotations

import asyncio
import logging
import threading

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.partitioner.default import murmur2

from clora.settings import KafkaSettings, kafka_client_kwargs
from clora.ingest.schemas import ALL_TOPICS

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """The broker did not acknowledge a write in time: the event was NOT stored."""


def ensure_topics(bootstrap: str, partitions: int, topics: tuple[str, ...] = ALL_TOPICS,
                  kafka: KafkaSettings | None = None) -> None:
    """Create clora's topics if missing (idempotent), each with `kafka.replication_factor`
    replicas and `min.insync.replicas` of `kafka.min_insync_replicas` (None: the settings from
    the environment). Topics that exist already are left as they are."""
    kafka = kafka or KafkaSettings()
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **kafka_client_kwargs(kafka))
    try:
        existing = set(admin.list_topics())
        config = {"min.insync.replicas": str(kafka.min_insync_replicas)}
        missing = [NewTopic(t, partitions, kafka.replication_factor, topic_configs=config)
                   for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


class EventProducer:
    """One acks=all producer shared by a process. `send_sync` and `send_many_and_wait` raise
    `BrokerUnavailable` unless the broker acknowledged within `timeout_s`."""

    def __init__(self, bootstrap: str, *, timeout_s: float = 5.0, linger_ms: int = 2):
        self.timeout_s = timeout_s
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            linger_ms=linger_ms,
            retries=3,
            max_block_ms=int(timeout_s * 1000),       # metadata waits count against the same budget
            request_timeout_ms=max(1000, int(timeout_s * 1000)),
            max_in_flight_requests_per_connection=5,
            batch_size=256 * 1024,
            **kafka_client_kwargs(),
        )
        self._known_topics: set[str] = set()

    def send(self, topic: str, key: str, value: str | bytes, partition: int | None = None):
        """Queue one record; returns kafka-python's future. Raises BrokerUnavailable if the
        producer cannot even queue it (no metadata within the timeout)."""
        payload = value.encode() if isinstance(value, str) else value
        try:
            return self._producer.send(topic, key=key.encode(), value=payload, partition=partition)
        except KafkaError as e:
            raise BrokerUnavailable(f"could not queue a record for {topic}: {e}") from e

    def send_sync(self, topic: str, key: str, value: str | bytes) -> None:
        fut = self.send(topic, key, value)
        try:
            fut.get(timeout=self.timeout_s)
        except KafkaError as e:
            raise BrokerUnavailable(f"broker did not acknowledge a write to {topic}: {e}") from e

    async def send_many_and_wait(self, topic: str, records: list[tuple[str, str | bytes]]) -> None:
        """Queue records and wait until the broker acknowledged every one of them.

        Every record's own future is checked (a batch can fail one record), but the event loop
        is woken once per call, not once per record: the producer's I/O thread counts the
        acknowledgements and settles the call when the last one arrives. Records that share a
        key get the partition the producer's partitioner picks for that key, computed once.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        remaining = len(records)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def settle(exc: BaseException | None) -> None:   # on the producer's I/O thread
            nonlocal remaining
            with lock:
                if exc is not None:
                    errors.append(exc)
                remaining -= 1
                last = remaining == 0
            if last:
                loop.call_soon_threadsafe(finish)

        def ok(_metadata) -> None:
            settle(None)

        def queue_all() -> None:
            partitions: dict[str, int] = {}
            for key, value in records:
                if key not in partitions:
                    partitions[key] = self._partition_for(topic, key)
                fut = self.send(topic, key, value, partition=partitions[key])
                fut.add_callback(ok)
                fut.add_errback(settle)

        if topic in self._known_topics:
            queue_all()                      # metadata cached: send() only appends to a buffer
        else:
            # the first send may block for metadata (up to max_block_ms): off the event loop
            await asyncio.to_thread(queue_all)
            self._known_topics.add(topic)
        try:
            await asyncio.wait_for(done, timeout=self.timeout_s)
        except asyncio.TimeoutError as e:
            raise BrokerUnavailable(f"broker did not acknowledge {remaining} of {len(records)} writes "
                                    f"to {topic} within {self.timeout_s} s") from e
        if errors:
            raise BrokerUnavailable(f"broker refused {len(errors)} of {len(records)} writes to {topic}: "
                                    f"{errors[0]}") from errors[0]

    def _partition_for(self, topic: str, key: str) -> int | None:
        """The partition kafka-python's DefaultPartitioner (ours: we configure no other) gives
        `key`: murmur2 of the key over the sorted partitions. None, letting send() pick, while
        the topic's partitions are not known yet."""
        partitions = self._producer.partitions_for(topic) if topic in self._known_topics else None
        if not partitions:
            return None
        ordered = sorted(partitions)
        return ordered[(murmur2(key.encode()) & 0x7FFFFFFF) % len(ordered)]

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout)

    def close(self) -> None:
        self._producer.close(timeout=self.timeout_s)

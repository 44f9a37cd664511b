"""Kafka producing for clora: topic creation and an acks=all producer whose writes can be
awaited from asyncio (the webhook answers 202 only after the broker acknowledged). Both connect
with the platform's Kafka client settings (`clora.settings.KafkaSettings`: TLS, SASL) and create
topics with its replication factor and `min.insync.replicas`.

    producer = EventProducer(bootstrap)
    await producer.send_many_and_wait(TOPIC_FEEDBACK, [(tenant, event.model_dump_json())])

The producer is librdkafka's (`confluent_kafka`): it batches and acknowledges in C, at a
quarter of kafka-python's CPU per record, which bounds how many feedback events a webhook
process accepts per core. Records with a key go to the partition Java's (and kafka-python's)
default partitioner gives it (murmur2), so a tenant's records share one partition whichever
client wrote them. Topics are created with kafka-python's admin client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading

from confluent_kafka import KafkaError as RdKafkaError
from confluent_kafka import KafkaException, Producer
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from clora.settings import KafkaSettings, kafka_client_kwargs, librdkafka_config
from clora.ingest.schemas import ALL_TOPICS

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """The broker did not acknowledge a write in time: the event was NOT stored."""


class RecordRefused(BrokerUnavailable):
    """The record itself is refused (too large, invalid): no retry can store it."""


REFUSED_FOR_GOOD = frozenset({RdKafkaError.MSG_SIZE_TOO_LARGE, RdKafkaError.INVALID_MSG, RdKafkaError.INVALID_MSG_SIZE,
                              RdKafkaError.RECORD_LIST_TOO_LARGE, RdKafkaError.INVALID_RECORD})
"""librdkafka's error codes for a record no retry can store."""


def _failure(error: RdKafkaError, what: str) -> BrokerUnavailable:
    kind = RecordRefused if error.code() in REFUSED_FOR_GOOD else BrokerUnavailable
    return kind(f"{what}: {error.str()} ({error.name()})")


class Delivery(cf.Future):
    """One record's acknowledgement. `get` waits for it and raises `BrokerUnavailable` (or
    `RecordRefused`) unless the broker stored the record within `timeout`."""

    def get(self, timeout: float | None = None) -> None:
        try:
            return self.result(timeout)
        except cf.TimeoutError as e:
            raise BrokerUnavailable(f"no acknowledgement within {timeout} s") from e


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
    `BrokerUnavailable` unless the broker acknowledged within `timeout_s`. librdkafka gives up
    on a record after the same time (`message.timeout.ms`), so one reported as failed is not
    sent again later; one already on the wire may still be stored, so a caller's retry can
    duplicate it (clora's consumers store each event id once). A thread serves the
    acknowledgements."""

    def __init__(self, bootstrap: str, *, timeout_s: float = 5.0, linger_ms: int = 2):
        self.timeout_s = timeout_s
        self._producer = Producer({
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": linger_ms,
            "message.timeout.ms": max(1000, int(timeout_s * 1000)),   # every retry within the ack budget
            "partitioner": "murmur2_random",          # Java's and kafka-python's: murmur2 of the key
            "max.in.flight.requests.per.connection": 5,
            "batch.size": 256 * 1024,
            **librdkafka_config(),
        }, logger=log)                                # librdkafka's own log lines, through logging
        self._closed = threading.Event()
        self._acks = threading.Thread(target=self._serve_acks, name="kafka-producer-acks", daemon=True)
        self._acks.start()

    def _serve_acks(self) -> None:
        while not self._closed.is_set():
            try:
                self._producer.poll(0.05)         # runs the delivery callbacks
            except Exception:  # noqa: BLE001 - a callback's error must not stop every later ack
                log.exception("a Kafka delivery callback failed")

    def _produce(self, topic: str, key: str, value: str | bytes, on_delivery) -> None:
        payload = value.encode() if isinstance(value, str) else value
        try:
            self._producer.produce(topic, payload, key.encode(), on_delivery=on_delivery)
        except BufferError as e:                  # the local queue is full: the broker is not keeping up
            raise BrokerUnavailable(f"could not queue a record for {topic}: the producer's queue is full") from e
        except KafkaException as e:
            raise _failure(e.args[0], f"could not queue a record for {topic}") from e

    def send(self, topic: str, key: str, value: str | bytes) -> Delivery:
        """Queue one record; returns its `Delivery`. Raises BrokerUnavailable (RecordRefused for
        one too large) if the producer cannot even queue it."""
        delivery = Delivery()

        def delivered(err, _msg) -> None:       # on the acknowledgement thread
            if err is None:
                delivery.set_result(None)
            else:
                delivery.set_exception(_failure(err, f"broker did not store a write to {topic}"))
        self._produce(topic, key, value, delivered)
        return delivery

    def send_sync(self, topic: str, key: str, value: str | bytes) -> None:
        self.send(topic, key, value).get(timeout=self.timeout_s)

    async def send_many_and_wait(self, topic: str, records: list[tuple[str, str | bytes]]) -> None:
        """Queue records and wait until the broker acknowledged every one of them.

        Every record's own acknowledgement is checked (a batch can fail one record), but the
        event loop is woken once per call, not once per record: the acknowledgement thread
        counts them and settles the call when the last one arrives. Queuing does not block:
        librdkafka fetches metadata itself and appends to its own buffer.
        """
        if not records:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        remaining = len(records)
        errors: list[BaseException] = []
        lock = threading.Lock()          # callbacks run on the acknowledgement thread, or in a flush

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def delivered(err, _msg) -> None:
            nonlocal remaining
            with lock:
                if err is not None:
                    errors.append(_failure(err, f"broker did not store a write to {topic}"))
                remaining -= 1
                last = remaining == 0
            if last:
                try:
                    loop.call_soon_threadsafe(finish)
                except RuntimeError:           # the caller gave up and its loop is closed
                    pass

        # a queue found full midway raises: the caller is told nothing was stored, though what
        # was queued before may still be (a retry then duplicates it; consumers deduplicate)
        for key, value in records:
            self._produce(topic, key, value, delivered)
        try:
            await asyncio.wait_for(done, timeout=self.timeout_s)
        except asyncio.TimeoutError as e:
            raise BrokerUnavailable(f"broker did not acknowledge {remaining} of {len(records)} writes "
                                    f"to {topic} within {self.timeout_s} s") from e
        if errors:
            raise errors[0].__class__(f"broker did not store {len(errors)} of {len(records)} writes to "
                                      f"{topic}: {errors[0]}") from errors[0]

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued record is acknowledged or failed; BrokerUnavailable if some
        are still in flight after `timeout` (None: `timeout_s`)."""
        wait_s = self.timeout_s if timeout is None else timeout
        if left := self._producer.flush(wait_s):
            raise BrokerUnavailable(f"{left} records still unacknowledged after {wait_s} s")

    def close(self) -> None:
        """Flush (up to `timeout_s`), then stop serving acknowledgements. Records still in
        flight then are logged, not raised: each caller's own wait reports its records."""
        try:
            if left := self._producer.flush(self.timeout_s):
                log.warning("closing the producer with %d records unacknowledged after %s s", left, self.timeout_s)
        finally:
            self._closed.set()
            self._acks.join(timeout=self.timeout_s)

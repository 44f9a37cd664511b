"""The ingest worker's consumer-group member, on librdkafka (`confluent_kafka.Consumer`).

    consumer = GroupConsumer(bootstrap, settings, [TOPIC_FEEDBACK], client_id="clora-ingest-0")
    records = consumer.poll(0.5)                 # [Record(topic, partition, offset, key, value)]
    consumer.commit({("clora.feedback", 3): 1042})

Why librdkafka. kafka-python's consumer unpacks every record in Python: against the embedded
broker it cost 45-46 CPU-us a record, where librdkafka's cost 5.5-6.1 (one process each,
40,000 records of 300 bytes, polls of 500 with a commit after each). With the producer on
librdkafka already, that unpacking was the largest share of what the worker costs the machine
per event, and the worker bounds batched ingest.

What it keeps from the kafka-python member it replaces:
- offsets are committed only by `commit`, explicitly and synchronously, after Redis has a
  batch (never automatically), so a crash redelivers what was not stored;
- `poll` returns as soon as one record is there, with everything else already fetched, up to
  `max_poll_records` (librdkafka's batch call alone would wait out its timeout for a full batch,
  which adds that timeout to the accept -> buffer latency at low load);
- the group join's rebalance timeout is `max_poll_interval_ms` (short against Tansu, see
  `IngestSettings`), raised to the session timeout where it is below it, as librdkafka requires;
- every broker request is bounded by `request_timeout_ms` (`socket.timeout.ms`).

A commit the group refuses (the member was rebalanced out, or the coordinator moved) raises
`CommitRefused`: the batch is redelivered to whoever holds its partitions, and de-duplication
makes that harmless.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, TopicPartition

from clora.ingest.settings import IngestSettings
from clora.settings import librdkafka_config

log = logging.getLogger(__name__)


class Record(NamedTuple):
    """One consumed record, as the worker's parser reads it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class CommitRefused(RuntimeError):
    """The offsets were not committed; the records will be delivered again."""


def consumer_config(bootstrap: str, settings: IngestSettings, client_id: str) -> dict[str, object]:
    """librdkafka's configuration of an ingest worker's group member."""
    s = settings
    return {
        "bootstrap.servers": bootstrap,
        "group.id": s.group_id,
        "client.id": client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": s.session_timeout_ms,
        "heartbeat.interval.ms": max(500, s.session_timeout_ms // 3),
        "max.poll.interval.ms": max(s.max_poll_interval_ms, s.session_timeout_ms),
        "socket.timeout.ms": s.request_timeout_ms,
        "fetch.wait.max.ms": s.fetch_max_wait_ms,
        **librdkafka_config(),
    }


class GroupConsumer:
    """One member of the ingest group over `topics`; see the module's docstring."""

    def __init__(self, bootstrap: str, settings: IngestSettings, topics: list[str], *, client_id: str):
        self.max_records = settings.max_poll_records
        self._consumer = Consumer(consumer_config(bootstrap, settings, client_id), logger=log)
        self._consumer.subscribe(topics, on_assign=_logged("assigned"), on_revoke=_logged("revoked"))

    def poll(self, timeout_s: float) -> list[Record]:
        """The records that have arrived, up to `max_poll_records`, waiting up to `timeout_s` for
        the first. Errors librdkafka reports in the stream (a topic not created yet, a broker
        down) are logged and skipped; a fatal one raises `KafkaException`."""
        first = self._consumer.poll(timeout_s)
        if first is None:
            return []
        messages = [first]
        if self.max_records > 1:
            messages += self._consumer.consume(self.max_records - 1, 0)
        records = []
        for m in messages:
            err = m.error()
            if err is None:
                records.append(Record(m.topic(), m.partition(), m.offset(), m.key(), m.value()))
            elif err.fatal():
                raise KafkaException(err)
            else:
                log.warning("consumer: %s", err.str())
        return records

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        """Commit, synchronously, the next offset to read of each (topic, partition)."""
        try:
            self._consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                  asynchronous=False)
        except KafkaException as e:
            raise CommitRefused(str(e.args[0])) from e

    def assignment(self) -> list[tuple[str, int]]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def highwater(self, topic: str, partition: int) -> int | None:
        """The partition's high-water mark as of the last fetch (no broker call), None if none yet."""
        try:
            _low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
        except KafkaException:
            return None
        return None if high in (OFFSET_INVALID, -1) else high

    def close(self) -> None:
        """Leave the group (committing nothing)."""
        self._consumer.close()


def _logged(what: str):
    def callback(_consumer, partitions) -> None:
        log.info("partitions %s: %s", what, ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "none")
    return callback

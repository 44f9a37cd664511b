"""Read a topic's records for one key, from the start, until what was read is enough.

A fixed `consumer_timeout_ms` also has to cover the consumer's metadata fetch, offset reset and
first fetch, which a loaded machine can stretch past it; this polls until `done` says the
records are all there (or the deadline passes, and the caller's assertion shows what came)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kafka import KafkaConsumer


def read_keyed(bootstrap: str, topic: str, key: str, done: Callable[[list[bytes]], bool],
               timeout_s: float = 30.0) -> list[bytes]:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None,
                             enable_auto_commit=False)
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not done(values) and time.monotonic() < deadline:
            for batch in consumer.poll(500).values():
                values += [m.value for m in batch if m.key == key.encode()]
    finally:
        consumer.close()
    return values

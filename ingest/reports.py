"""What the platform leaves in Redis for the console, which has no Prometheus of its own:
each consumer group's lag, the latest dead letters, and the supervisor's service events. This
module owns the keys:

    clora:ingest:lag:{group}    hash  "topic:partition" -> lag, the whole group's, measured from the
                                      broker every ~2 s by `clora up` (`LagProbe`)
    clora:dlq:recent            list  the latest `DeadLetter`s as JSON, newest first (at most 1000)
    clora:platform:events       list  the latest `ServiceEvent`s as JSON, newest first (at most 1000):
                                      restarts, hangs, and a broker restart's data loss

The dead letters themselves go to the `clora.dlq` topic; this list is only the console's view.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis
from kafka import KafkaConsumer, TopicPartition

from clora.settings import kafka_client_kwargs
from clora.ingest.schemas import TOPIC_FEEDBACK, TOPIC_INTERACTIONS, DeadLetter

_LAG_KEY = "clora:ingest:lag"
_DLQ_RECENT_KEY = "clora:dlq:recent"
_EVENTS_KEY = "clora:platform:events"
DLQ_RECENT_MAX = 1000
"""Dead letters the console can list (and replay)."""
EVENTS_MAX = 1000
"""Service events the console can list."""


class LagProbe:
    """Measures a consumer group's lag from the broker: for every partition of the ingest topics,
    its high watermark minus the group's committed offset (its first offset when none is
    committed). It never joins the group.

        probe = LagProbe("127.0.0.1:19092", "clora-ingest")
        probe.measure()      # {"clora.feedback:0": 12, "clora.feedback:1": 0, ...}

    The high watermark is read from a fetch response: Tansu 0.6 answers a ListOffsets(latest)
    with the last *batch's* first offset + 1 (11 after batches of 10 and 5 records, not 15), which
    serves here only as a position close to the end to fetch from. Each measure uses a fresh
    client (a watermark from an earlier fetch would be stale).
    """

    def __init__(self, bootstrap: str, group: str, *, topics: tuple[str, ...] = (TOPIC_INTERACTIONS, TOPIC_FEEDBACK),
                 timeout_ms: int = 5000):
        self.bootstrap, self.group, self.topics, self.timeout_ms = bootstrap, group, topics, timeout_ms
        self.committed: dict[str, int] = {}
        """The group's committed offsets as of the last `measure`."""
        self._kafka = kafka_client_kwargs()

    def measure(self) -> dict[str, int]:
        """Lag per "topic:partition". Raises kafka's errors (KafkaTimeoutError when the broker
        does not answer within `timeout_ms`)."""
        from kafka.errors import KafkaTimeoutError

        c = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group, enable_auto_commit=False,
                          request_timeout_ms=self.timeout_ms, fetch_max_wait_ms=100,
                          max_partition_fetch_bytes=64 * 1024, client_id=f"clora-lag-{self.group}",
                          **self._kafka)
        try:
            parts = [TopicPartition(t, p) for t in self.topics for p in sorted(c.partitions_for_topic(t) or ())]
            if not parts:
                return {}
            near_end = c.end_offsets(parts, timeout_ms=self.timeout_ms)
            first = c.beginning_offsets(parts, timeout_ms=self.timeout_ms)
            c.assign(parts)
            for tp in parts:
                c.seek(tp, near_end[tp])
            deadline = time.monotonic() + self.timeout_ms / 1000
            while any(c.highwater(tp) is None for tp in parts):
                if time.monotonic() > deadline:
                    raise KafkaTimeoutError(f"no high watermark from the broker within {self.timeout_ms} ms")
                c.poll(timeout_ms=200, max_records=1)
            lags, committed_now = {}, {}
            for tp in parts:
                committed = c.committed(tp, timeout_ms=self.timeout_ms)
                done = first[tp] if committed is None else committed
                lags[f"{tp.topic}:{tp.partition}"] = max(0, c.highwater(tp) - done)
                committed_now[f"{tp.topic}:{tp.partition}"] = done
            self.committed = committed_now
            return lags
        finally:
            c.close(autocommit=False, timeout_ms=self.timeout_ms)

    def close(self) -> None:
        """Nothing held between measures; kept so a caller can treat it as a resource."""


def record_lag(client: redis.Redis, group: str, lags: dict[str, int]) -> None:
    """Replace the group's lag with `lags`, every partition's: {"clora.feedback:0": 12, ...}."""
    pipe = client.pipeline()                  # MULTI: the console never reads half of it
    pipe.delete(f"{_LAG_KEY}:{group}")
    if lags:
        pipe.hset(f"{_LAG_KEY}:{group}", mapping=lags)
    pipe.execute()


def consumer_lag(client: redis.Redis, group: str) -> int | None:
    """The group's total lag over every partition reported, None when none was."""
    lags = client.hgetall(f"{_LAG_KEY}:{group}")
    return sum(int(v) for v in lags.values()) if lags else None


def record_dead_letters(client: redis.Redis, letters: list[DeadLetter]) -> None:
    """Put `letters` at the head of the recent list (one transaction), trimmed to
    `DLQ_RECENT_MAX`."""
    pipe = client.pipeline()
    for letter in letters:
        pipe.lpush(_DLQ_RECENT_KEY, letter.model_dump_json())
    pipe.ltrim(_DLQ_RECENT_KEY, 0, DLQ_RECENT_MAX - 1)
    pipe.execute()


def recent_dead_letters(client: redis.Redis, n: int | None = None) -> list[DeadLetter]:
    """The latest `n` dead letters (all kept when None), newest first."""
    raws = client.lrange(_DLQ_RECENT_KEY, 0, -1 if n is None else n - 1)
    return [DeadLetter.model_validate_json(raw) for raw in raws]


@dataclass(frozen=True)
class ServiceEvent:
    """What the supervisor did about a service, as the console lists it, e.g.
    `ServiceEvent(time=1767225600.0, service="broker", kind="data_lost", detail="the embedded broker
    restarted empty: ...")`. Kinds: exited, unresponsive, restarted, restart_failed, data_lost, stalled."""

    time: float
    service: str
    kind: str
    detail: str


def record_service_event(client: redis.Redis, event: ServiceEvent) -> None:
    """Put `event` at the head of the events list (one transaction), trimmed to `EVENTS_MAX`."""
    pipe = client.pipeline()
    pipe.lpush(_EVENTS_KEY, json.dumps(asdict(event)))
    pipe.ltrim(_EVENTS_KEY, 0, EVENTS_MAX - 1)
    pipe.execute()


def recent_service_events(client: redis.Redis, n: int | None = None) -> list[ServiceEvent]:
    """The latest `n` service events (all kept when None), newest first."""
    raws = client.lrange(_EVENTS_KEY, 0, -1 if n is None else n - 1)
    return [ServiceEvent(**json.loads(raw)) for raw in raws]

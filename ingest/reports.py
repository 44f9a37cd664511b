"""What the ingest workers leave in Redis for the console, which has no Prometheus of its own:
each consumer group's lag and the latest dead letters. This module owns both keys:

    clora:ingest:lag:{group}    hash  "topic:partition" -> lag, refreshed every ~2 s by the members
    clora:dlq:recent            list  the latest `DeadLetter`s as JSON, newest first (at most 1000)

The dead letters themselves go to the `clora.dlq` topic; this list is only the console's view.
"""

from __future__ import annotations

import redis

from clora.ingest.schemas import DeadLetter

_LAG_KEY = "clora:ingest:lag"
_DLQ_RECENT_KEY = "clora:dlq:recent"
DLQ_RECENT_MAX = 1000
"""Dead letters the console can list (and replay)."""


def record_lag(client: redis.Redis, group: str, lags: dict[str, int]) -> None:
    """Set the lag of the partitions one member holds: {"clora.feedback:0": 12, ...}."""
    if lags:
        client.hset(f"{_LAG_KEY}:{group}", mapping=lags)


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

"""Each tenant's serving traffic per minute, for the console: requests, refusals, errors,
latency and tokens. The gateway counts in memory (on its event loop) and adds the counts to
Redis every few seconds (`Registry.add_traffic`, one transaction); the console reads the last
hour (`Registry.traffic`). A Redis outage keeps the counts until a later flush takes them.

Counters of one minute: `requests` (answered, whatever the status), `ok` (200), `refused`
(4xx: validation, quota, unknown model), `errors` (5xx, and streams the engine broke),
`latency_s` (the sum over `ok` requests: its mean is `latency_s / ok`), `prompt_tokens`,
`completion_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict

import redis

from clora.registry import TRAFFIC_TTL_S, Registry

log = logging.getLogger(__name__)

CLIENT_LEFT = 499
"""The status a stream counts with when its client went away before the end."""


def _no_counts() -> dict[tuple[str, int], dict[str, float]]:
    """(tenant, minute) -> counter -> value, every one starting at 0."""
    return defaultdict(lambda: defaultdict(float))


class TrafficRollup:
    def __init__(self, registry: Registry, *, flush_s: float = 5.0, clock=time.time):
        self.registry, self.flush_s, self.clock = registry, flush_s, clock
        self.pending = _no_counts()
        self._task: asyncio.Task | None = None

    def answered(self, tenant: str, status: int, seconds: float) -> None:
        counts = self.pending[(tenant, int(self.clock() // 60))]
        counts["requests"] += 1
        if status == 200:
            counts["ok"] += 1
            counts["latency_s"] += seconds
        elif status >= 500:
            counts["errors"] += 1
        elif status != CLIENT_LEFT:
            counts["refused"] += 1

    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        counts = self.pending[(tenant, int(self.clock() // 60))]
        counts["prompt_tokens"] += prompt_tokens
        counts["completion_tokens"] += completion_tokens

    async def flush(self) -> None:
        """Add what was counted since the last flush to Redis (kept for the next one on failure)."""
        batch, self.pending = self.pending, _no_counts()
        if not batch:
            return
        try:
            await asyncio.to_thread(self.registry.add_traffic, {k: dict(v) for k, v in batch.items()})
        except (redis.RedisError, OSError) as e:
            oldest = int(self.clock() // 60) - TRAFFIC_TTL_S // 60
            for key, counts in batch.items():
                if key[1] > oldest:
                    for name, value in counts.items():
                        self.pending[key][name] += value
            log.warning("serving traffic not stored yet (%s); kept for the next flush", e)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="traffic-rollup")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

"""Feedback -> served freshness, on the gateway's side: `FreshnessTracker`.

When the gateway has answered a completion with version v of tenant T (`served`), the tracker
claims T's v as first served now (`Registry.claim_first_served`, atomic across gateways), and
only the claimer measures it: each event of v's lineage (the feedback events first trained in
v, `clora.freshness`) is observed in `clora_feedback_to_served_seconds`, and v's
`FreshnessSummary` (events, p50, p99, first served, publish -> served) is stored on the registry
for the console.

The request path pays one set lookup: the registry work runs in a worker thread, once per
(tenant, version) per process (the claimed pairs are remembered, the newest `remember` of
them). A claim that fails (Redis down) is forgotten, so a later completion tries again; one that
failed after the claim is logged and not measured (the claim is taken).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from clora.freshness import FreshnessSummary
from clora.registry import RegistryError
from clora.serving.aliases import AdapterRef
from clora.serving.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class FreshnessTracker:
    def __init__(self, registry, metrics: GatewayMetrics, *, clock: Callable[[], float] = time.time,
                 remember: int = 10_000):
        """`registry`: a `clora.registry.Registry` (claim_first_served, lineage, adapter_version,
        record_freshness)."""
        self.registry, self.metrics, self.clock, self.remember = registry, metrics, clock, remember
        self._claimed: OrderedDict[tuple[str, int], None] = OrderedDict()
        """(tenant, version) pairs this process has claimed or seen claimed, oldest first."""
        self._pending: set[asyncio.Task] = set()

    def served(self, ref: AdapterRef | None) -> None:
        """A completion was just answered with `ref` (None: the base model, which no feedback
        trains). Call on the event loop; returns at once."""
        if ref is None:
            return
        key = (ref.tenant, ref.version)
        if key in self._claimed:
            return
        self._claimed[key] = None
        while len(self._claimed) > self.remember:
            self._claimed.popitem(last=False)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._claim, ref.tenant, ref.version,
                                                                        self.clock()))
        self._pending.add(task)
        task.add_done_callback(lambda t, key=key: self._done(t, key))

    def _claim(self, tenant: str, version: int, at: float) -> FreshnessSummary | None:
        """Claim `version` as first served at `at`; when this call won, measure it. Returns the
        summary it stored (None: another gateway, or this one before a restart, was first)."""
        if not self.registry.claim_first_served(tenant, version, at):
            return None
        lineage = self.registry.lineage(tenant, version)
        try:
            created: float | None = self.registry.adapter_version(tenant, version).created_at
        except RegistryError:  # pruned meanwhile: its events are still measured
            created = None
        summary = FreshnessSummary.of(lineage, at, created)
        self.metrics.fresh(tenant, lineage.freshness(at))
        self.registry.record_freshness(tenant, version, summary)
        if summary.events:
            log.info("%s v%d first served %.1f s after its publish; its %d feedback events: p50 %.1f s, p99 %.1f s "
                     "from their 202", tenant, version, summary.published_to_served_s or 0.0, summary.events,
                     summary.p50_s, summary.p99_s)
        return summary

    def _done(self, task: asyncio.Task, key: tuple[str, int]) -> None:
        self._pending.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self._claimed.pop(key, None)  # a later completion tries again (a taken claim then measures nothing)
        log.warning("measuring the freshness of %s v%d failed: %r", *key, task.exception())

    async def drain(self) -> None:
        """Wait for every measurement in flight (tests, shutdown)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

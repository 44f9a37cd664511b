"""Versioned hot swap: keep each tenant's alias on the registry's live adapter version.

`HotSwapper.reconcile(tenant)` reads the live version from the registry; when it differs
from the alias it (1) loads the new version into every healthy replica under its own name
(`acme@v8`, its own folder), each load verified by the version's canary (a replica that fails it
is out of rotation for v8 alone; the swap goes on once any replica took it), (2) switches the
alias in one assignment — requests admitted from then on use v8, requests already running keep
v7 — and (3) in the background waits for v7's in-flight requests to drain and unloads it. A
rollback is the same move backwards.

Triggers: `clora.adapters` events (published / promoted / rolled_back), consumed by
`AdapterEventListener`, and a registry poll every `registry_poll_s` for tenants the gateway
knows (plus a full tenant-list refresh every `tenant_refresh_s`), so a missed event only
delays a swap by one poll.

A version the engine refuses (a missing or broken folder) is retried with a growing wait
(`LOAD_RETRY_S` doubling up to `LOAD_RETRY_MAX_S`) instead of on every poll: each attempt costs
the engine a load and may first evict another tenant's idle adapter to make room. An adapter
event for the tenant retries at once. When the fault is not the adapter's (no slot came free,
a replica died or none is up), the next poll retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import redis
from kafka import KafkaConsumer
from kafka.errors import KafkaError

from clora.registry import Registry, RegistryError
from clora.settings import kafka_client_kwargs
from clora.ingest.schemas import TOPIC_ADAPTERS, AdapterEvent
from clora.serving.aliases import AdapterRef, AliasTable
from clora.serving.engine import AdapterLoadError, EngineManager, EngineUnavailable
from clora.serving.metrics import GatewayMetrics

log = logging.getLogger(__name__)

LOAD_RETRY_S = 1.0
LOAD_RETRY_MAX_S = 60.0
KEEP_SWAPS = 1000
"""`HotSwapper.swaps` keeps the latest 1000-2000 swaps."""


@dataclass(frozen=True)
class Swap:
    """One alias switch, for metrics and tests."""

    tenant: str
    old: AdapterRef | None
    new: AdapterRef | None
    started: float
    """time.time() when the new live version was noticed."""
    switched: float
    """time.time() when the alias pointed at the new version (it serves from then on)."""


class HotSwapper:
    def __init__(self, registry: Registry, aliases: AliasTable, engine: EngineManager, *,
                 poll_s: float = 0.25, refresh_s: float = 5.0, drain_timeout_s: float = 600.0,
                 clock=time.monotonic, metrics: GatewayMetrics | None = None):
        self.registry, self.aliases, self.engine, self.clock = registry, aliases, engine, clock
        self.poll_s, self.refresh_s, self.drain_timeout_s = poll_s, refresh_s, drain_timeout_s
        self.swaps: list[Swap] = []
        """The latest swaps (tests and benchmarks read them; `metrics` counts them all). A list,
        trimmed to `KEEP_SWAPS` by rebinding: another thread may be iterating over it."""
        self.metrics = metrics
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._known: set[str] = set()
        self._retiring: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._load_failures: dict[AdapterRef, tuple[int, float]] = {}
        """A version that failed to load -> (failures so far, clock time of the next try)."""

    async def live_ref(self, tenant: str) -> AdapterRef | None:
        """The tenant's live adapter (reconciling first if the gateway has not seen the tenant)."""
        ref = self.aliases.get(tenant)
        if ref is None:
            self._known.add(tenant)
            await self.reconcile(tenant)
            ref = self.aliases.get(tenant)
        return ref

    def _read_live(self, tenant: str, current: AdapterRef | None) -> AdapterRef | None:
        version = self.registry.live_version(tenant)
        if version is None:
            return None
        if current is not None and current.version == version:
            return current  # unchanged: one Redis read per tenant and poll
        av = self.registry.adapter_version(tenant, version)
        return AdapterRef.of(tenant, av)

    async def reconcile(self, tenant: str, *, retry_now: bool = False) -> None:
        """Swap the tenant's alias to its live version if that changed. `retry_now` (an adapter
        event) ignores the wait after a failed load."""
        async with self._locks[tenant]:
            started = time.time()
            old = self.aliases.get(tenant)
            try:
                new = await asyncio.to_thread(self._read_live, tenant, old)
            except RegistryError as e:
                log.error("reading tenant %s's live adapter failed: %s", tenant, e)
                return
            if new == old:
                return
            if new is not None:
                failed = self._load_failures.get(new)
                if failed and not retry_now and self.clock() < failed[1]:
                    return
                try:
                    await self.engine.preload(new)
                except (AdapterLoadError, EngineUnavailable) as e:  # keep serving the old version
                    serving = old.name if old else "nothing"
                    if isinstance(e, AdapterLoadError) and not e.transient:  # the engine refused it
                        n = failed[0] + 1 if failed else 1
                        wait = min(LOAD_RETRY_MAX_S, LOAD_RETRY_S * 2 ** (n - 1))
                        self._load_failures[new] = (n, self.clock() + wait)
                        log.error("hot swap of tenant %s to v%d failed (%d time(s); next try in %.0f s), "
                                  "still serving %s: %s", tenant, new.version, n, wait, serving, e)
                    else:  # not the adapter's fault: the next poll retries
                        log.error("hot swap of tenant %s to v%d not done, still serving %s: %s",
                                  tenant, new.version, serving, e)
                    return
                self._load_failures.pop(new, None)
            self.aliases.switch(tenant, new)
            swap = Swap(tenant, old, new, started, time.time())
            self.swaps.append(swap)
            if len(self.swaps) > 2 * KEEP_SWAPS:
                self.swaps = self.swaps[-KEEP_SWAPS:]
            if self.metrics is not None:
                self.metrics.swapped(tenant, swap.switched - swap.started)
            log.info("tenant %s: %s -> %s", tenant, old.name if old else None, new.name if new else None)
            if old is not None:
                task = asyncio.create_task(self.engine.retire(old, self.drain_timeout_s))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def run(self) -> None:
        """Poll the registry until cancelled. A Redis outage delays swaps; it never ends the loop."""
        last_refresh = 0.0
        while True:
            try:
                if time.monotonic() - last_refresh > self.refresh_s:
                    tenants = await asyncio.to_thread(self.registry.list_tenants)
                    self._known |= {t.id for t in tenants}
                    last_refresh = time.monotonic()
                for tenant in list(self._known):
                    await self.reconcile(tenant)
            except (RegistryError, redis.RedisError) as e:
                log.warning("registry poll failed (retrying): %s", e)
            except Exception:  # noqa: BLE001 - one tenant's failure must not end every tenant's swaps
                log.exception("hot-swap poll failed (retrying)")
            await asyncio.sleep(self.poll_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="hot-swap")

    async def stop(self) -> None:
        for t in [self._task, *self._retiring]:
            if t:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t


class AdapterEventListener:
    """Consumes `clora.adapters` (from the end: the registry holds the state) in a thread and
    asks the swapper to reconcile each named tenant at once."""

    def __init__(self, bootstrap: str, swapper: HotSwapper, loop: asyncio.AbstractEventLoop):
        self.bootstrap, self.swapper, self.loop = bootstrap, swapper, loop
        self._kafka = kafka_client_kwargs()       # a bad combination is refused here, not in the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = KafkaConsumer(TOPIC_ADAPTERS, bootstrap_servers=self.bootstrap, group_id=None,
                                             auto_offset_reset="latest", enable_auto_commit=False,
                                             consumer_timeout_ms=500, request_timeout_ms=10_000,
                                             **self._kafka)
                for batch in consumer.poll(timeout_ms=500).values():
                    for rec in batch:
                        self._handle(rec.value)
            except KafkaError as e:
                log.warning("adapter event consumer: %s (retrying; registry polling covers the gap)", e)
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()

    def _handle(self, raw: bytes) -> None:
        try:
            event = AdapterEvent.model_validate_json(raw)
        except ValueError as e:
            log.error("ignoring an invalid adapter event (the DLQ is the producer's job): %s", e)
            return
        asyncio.run_coroutine_threadsafe(self.swapper.reconcile(event.tenant, retry_now=True), self.loop)

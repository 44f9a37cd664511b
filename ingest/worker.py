"""Ingest worker: one consumer-group member over `clora.interactions` and `clora.feedback`
that turns events into per-tenant training examples in Redis.

    clora ingest-worker            # one member; run several for more partitions

Per poll: validate every record (invalid ones go to `clora.dlq` with the reason), store
interactions (counting each reply in its serving version's signals, `clora.ingest.signals`), join feedback with its interaction (or park it until the interaction comes),
write examples — all in pipelined Lua scripts — and only then commit the offsets. The next
poll is fetched, validated and joined while Redis stores the last one (`IngestWorker.run`). A crash
at any point redelivers the batch; the scripts' de-duplication makes that harmless, so every
accepted event lands in the buffers exactly once.

Liveness: every pass of the loop beats the worker's `Heartbeat` (the file `clora up` watches,
killing and restarting a worker that stops beating), and the worker's own watchdog exits it
when a pass takes longer than `stall_timeout_s`. Every broker call has a timeout
(`request_timeout_ms`). The group's lag is measured from the broker by `clora up`
(`reports.LagProbe`), not here: a hung worker could not report its own lag.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import redis
from confluent_kafka import KafkaException
from pydantic import ValidationError
from pydantic_core import to_json

from clora.procs import Heartbeat, tune_gc
from clora.registry import LearningPolicy, Registry, RegistryError
from clora.reward_spec import RewardSpec
from clora.ingest.settings import IngestSettings
from clora.ingest import metrics
from clora.ingest.consumer import CommitRefused, GroupConsumer
from clora.ingest.buffers import BufferBatch, BufferPolicy, InteractionWrite, ParkResult, PendingWrite, ReplayBuffer
from clora.ingest.joiner import join_stored, untrained_reason
from clora.ingest.producer import EventProducer
from clora.ingest.reports import record_dead_letters
from clora.ingest.signals import ReplyTraits
from clora.ingest.schemas import (TOPIC_DLQ, TOPIC_FEEDBACK, TOPIC_INTERACTIONS,
                                  DeadLetter, FeedbackEvent, InteractionEvent)

log = logging.getLogger(__name__)

FAULT_EXIT_CODE = 75
"""Exit code of the injected crash between storing a batch and committing it (`crash_after_store_file`)."""
TENANT_SCAN_S = 30.0
"""How often the worker lists the tenants whose buffer depths it exports (a SCAN of the whole
keyspace, which grows with every interaction kept). Tenants the worker stores examples for are
added as it does; another worker's new tenant shows within this many seconds. The depths are
read on a thread of their own (`IngestWorker._watch_depths`): on the consumer loop, the scan of
a few hundred thousand keys held the batches behind it for a few hundred milliseconds."""
GAUGE_INTERVAL_S = 2.0
"""How often the lag and depth gauges are updated."""
POLICY_CACHE_S = 5.0
"""How long a worker keeps a tenant's learning policy: an edit (buffer capacity, reward spec)
applies to what it stores within this many seconds."""


@dataclass
class _Batch:
    """One poll's records, parsed and sorted by what to do with them."""

    interactions: list[InteractionEvent] = field(default_factory=list)
    feedback: list[FeedbackEvent] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    size: int = 0
    """How many records it was parsed from."""


@dataclass
class _Writes:
    """A parsed batch's Redis writes, queued and not sent yet (`IngestWorker.prepare`)."""

    batch: _Batch
    calls: BufferBatch
    now: float
    interactions: list[InteractionWrite] = field(default_factory=list)
    """The items of its interaction store calls, in the order of their answers' parked lists."""
    store_calls: int = 0
    """How many of `calls` come first and store interactions; the park and add calls follow."""
    parked: list[FeedbackEvent] = field(default_factory=list)
    pending: list[PendingWrite] = field(default_factory=list)


@dataclass(frozen=True)
class _CachedPolicy:
    """A tenant's learning policy as the registry had it (None: no such tenant), until `expires`."""

    policy: LearningPolicy | None
    expires: float


def parse(record) -> InteractionEvent | FeedbackEvent | DeadLetter:
    """A consumer record as an event, or a dead letter saying why it is not one."""
    model = InteractionEvent if record.topic == TOPIC_INTERACTIONS else FeedbackEvent
    try:
        event = model.model_validate_json(record.value or b"")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        return _dead(record, f"invalid {model.__name__}: {where}: {first['msg']} ({e.error_count()} errors)")
    if record.key and record.key != event.tenant.encode():
        key = record.key.decode(errors="replace")
        return _dead(record, f"record key {key!r} does not match tenant {event.tenant!r}")
    return event


def _dead(record, reason: str) -> DeadLetter:
    return DeadLetter(source_topic=record.topic, source_partition=record.partition, source_offset=record.offset,
                      key=record.key.decode(errors="replace") if record.key else None,
                      payload=(record.value or b"").decode(errors="replace"), reason=reason)


class IngestWorker:
    """Consumes, joins and stores. `run(stop)` loops until `stop` is set."""

    def __init__(self, settings: IngestSettings, kafka_bootstrap: str, redis_url: str,
                 *, client_id: str = "clora-ingest", heartbeat: Heartbeat | None = None):
        self.settings = settings
        self.bootstrap = kafka_bootstrap
        self.r = redis.Redis.from_url(redis_url, socket_timeout=30, socket_connect_timeout=5)  # no call hangs
        self.buffers = ReplayBuffer(self.r, BufferPolicy(
            capacity=settings.buffer_capacity, eviction=settings.eviction,
            dedup_window=settings.dedup_window, interaction_ttl_s=settings.interaction_ttl_s))
        self.registry = Registry(self.r)
        self.client_id = client_id
        self.rate = metrics.RateMeter()
        self._dlq: EventProducer | None = None
        self._policies: dict[str, _CachedPolicy] = {}
        self.processed = 0
        self._committed: dict[tuple[str, int], int] = {}
        """The next offset of each partition after what this worker committed: its lag gauge's base."""
        self.heartbeat = heartbeat or Heartbeat(None)
        self._depth_tenants: set[str] = set()
        """The tenants whose buffer depths the gauges export (`TENANT_SCAN_S`)."""
        self._depth_lock = threading.Lock()
        """Guards `_depth_tenants`: the store thread adds to it, the depth thread reads it."""
        self._depth_tenants_at = -TENANT_SCAN_S

    # --- consumer loop --------------------------------------------------------------------

    def consumer(self) -> GroupConsumer:
        return GroupConsumer(self.bootstrap, self.settings, [TOPIC_INTERACTIONS, TOPIC_FEEDBACK],
                             client_id=self.client_id)

    def run(self, stop: threading.Event) -> None:
        """Poll, store, commit, until `stop`. Pipelined by one batch: a poll's records are fetched,
        parsed, joined and their writes built (`prepare`) while the batch before them is being
        written (`apply`, on one thread of its own), so the worker's Python and Redis's own work
        run side by side instead of in turn. Batches are stored one at a time and in order, and
        a batch's offsets are committed only after Redis has all of it."""
        self.heartbeat.beat()
        consumer = self.consumer()
        log.info("ingest worker %s joined group %s", self.client_id, self.settings.group_id)
        last_gauges = 0.0
        storing: tuple[Future[bool], list] | None = None      # the batch in Redis's hands, and its records
        pool = ThreadPoolExecutor(1, thread_name_prefix="clora-ingest-store")
        ended = threading.Event()
        threading.Thread(target=self._watch_depths, args=(stop, ended), name="clora-ingest-depths", daemon=True).start()
        try:
            while not stop.is_set():
                self.heartbeat.beat()
                # with a batch in flight, take only what has already arrived, so that its commit
                # never waits for new records
                records = consumer.poll(0 if storing else 0.5)
                batch = self.parse_all(records) if records else None
                writes = None
                if batch is not None:
                    try:
                        writes = self.prepare(batch)
                    except redis.RedisError:
                        pass                   # the store thread prepares it, retrying until Redis is back
                if storing is not None:
                    if not self._finish(consumer, storing):
                        return                 # stopping mid-outage: nothing committed, redelivered later
                    storing = None
                if batch is not None:
                    storing = pool.submit(self._store_until_stored, batch, writes, stop), records
                if time.monotonic() - last_gauges > GAUGE_INTERVAL_S:
                    try:
                        self._update_gauges(consumer)
                    except KafkaException as e:
                        log.warning("lag gauges not updated: %s", e)
                    last_gauges = time.monotonic()
            if storing is not None:
                self._finish(consumer, storing)
        finally:
            ended.set()
            pool.shutdown(wait=True)
            consumer.close()
            if self._dlq is not None:
                self._dlq.close()

    def _finish(self, consumer: GroupConsumer, storing: tuple[Future[bool], list]) -> bool:
        """Wait for the batch being stored to be in Redis, then commit its records' offsets (and
        only theirs: the consumer's position is already past the next poll). False if it was
        stopped before it was stored."""
        future, records = storing
        while not wait([future], timeout=1.0).done:
            self.heartbeat.beat()              # a store retrying through a Redis outage is not a hang
        if not future.result():                # its error, if it raised one
            return False
        self._maybe_crash_before_commit()
        offsets: dict[tuple[str, int], int] = {}
        for rec in records:
            tp = (rec.topic, rec.partition)
            offsets[tp] = max(offsets.get(tp, 0), rec.offset + 1)
        try:
            consumer.commit(offsets)               # only after Redis has every example
            for tp, off in offsets.items():
                self._committed[tp] = max(self._committed.get(tp, 0), off)
        except CommitRefused as e:
            # out of the group (a rebalance, a long Redis outage) or no answer in time: the
            # records go to whoever holds the partition then, and de-duplication makes that harmless
            log.warning("offset commit failed (%s); the batch will be redelivered", e)
        return True

    def _store_until_stored(self, batch: "_Batch", writes: "_Writes | None", stop: threading.Event) -> bool:
        """`apply` the batch's prepared `writes` (None: prepare them first), retrying with backoff
        while Redis is unreachable (the writes are idempotent, so a retry after a half-applied
        attempt stores nothing twice; a retry prepares the batch again). False if asked to stop
        before the batch was stored."""
        delay = 0.1
        while True:
            try:
                self.apply(writes or self.prepare(batch))
                return True
            except redis.RedisError as e:
                writes = None
                log.warning("Redis unavailable (%s); retrying %d records in %.1f s", e, batch.size, delay)
                if stop.wait(delay):
                    return False
                delay = min(delay * 2, 5.0)

    def _maybe_crash_before_commit(self) -> None:
        """The injected fault of `crash_after_store_file`: stored in Redis, not yet committed."""
        path = self.settings.crash_after_store_file
        if path and os.path.exists(path):
            os.unlink(path)
            log.error("fault injection: exiting after storing a batch, before committing it")
            logging.shutdown()
            os._exit(FAULT_EXIT_CODE)

    def _update_gauges(self, consumer: GroupConsumer) -> None:
        """This member's lag gauges, one per partition it holds (no I/O).

        The lag is the high-water mark minus what this worker committed itself, both known
        locally: it never asks the coordinator for committed offsets, a blocking call between
        polls (one, made while the group rebalanced, left kafka-python 3.0.12 rejoining the group
        in a loop). A partition this worker has committed nothing on yet has no lag reported."""
        for topic, partition in consumer.assignment():
            high, committed = consumer.highwater(topic, partition), self._committed.get((topic, partition))
            if high is not None and committed is not None:
                metrics.CONSUMER_LAG.labels(topic, str(partition)).set(max(0, high - committed))

    def _watch_depths(self, stop: threading.Event, ended: threading.Event) -> None:
        """Update the buffer-depth gauges every `GAUGE_INTERVAL_S` until `stop` or `ended`."""
        while not (stop.wait(GAUGE_INTERVAL_S) or ended.is_set()):
            try:
                self._update_depths()
            except redis.RedisError as e:
                log.warning("buffer depth gauges not updated: %s", e)

    def _update_depths(self) -> None:
        """The depth gauges of every tenant known to have data (`TENANT_SCAN_S`)."""
        if time.monotonic() - self._depth_tenants_at >= TENANT_SCAN_S:
            self._note_depth_tenants(self.buffers.tenants_with_data())
            self._depth_tenants_at = time.monotonic()
        with self._depth_lock:
            tenants = sorted(self._depth_tenants)
        for tenant, depths in self.buffers.depths(tenants).items():
            for kind, depth in depths.items():
                metrics.BUFFER_DEPTH.labels(tenant, kind).set(depth)

    def _note_depth_tenants(self, tenants) -> None:
        with self._depth_lock:
            self._depth_tenants.update(tenants)

    # --- one batch ------------------------------------------------------------------------

    def handle(self, records: list) -> None:
        """Process one poll's records. Returns after every effect is durable in Redis/Kafka."""
        self.store(self.parse_all(records))

    @staticmethod
    def parse_all(records: list) -> "_Batch":
        """One poll's records, validated and sorted (no I/O)."""
        batch = _Batch(size=len(records))
        for rec in records:
            event = parse(rec)
            if isinstance(event, InteractionEvent):
                batch.interactions.append(event)
            elif isinstance(event, FeedbackEvent):
                batch.feedback.append(event)
            else:
                batch.dead.append(event)
        return batch

    def store(self, batch: "_Batch") -> None:
        """Every effect of a parsed batch, durable in Redis/Kafka when it returns."""
        self.apply(self.prepare(batch))

    def prepare(self, batch: "_Batch") -> "_Writes":
        """The batch's writes, built and queued on one pipeline, not sent: each interaction's
        store, and each score joined with its interaction as Redis has it now (one read) or
        parked. What this read misses because an interaction is stored after it (in the same
        batch, or in the one still being stored) is found by the park script, which answers
        that the interaction is there, and joined again in `apply`."""
        now = time.time()
        w = _Writes(batch, self.buffers.batch(), now)
        by_tenant: dict[str, list[InteractionEvent]] = defaultdict(list)
        for ix in batch.interactions:
            by_tenant[ix.tenant].append(ix)
        for tenant, mine in by_tenant.items():     # one script call per tenant
            # each reply's traits: the reward-hacking guard's signals
            items = [InteractionWrite(ix.event_id, ix.interaction_id, ix.model_dump_json(), traits=ReplyTraits.of(ix))
                     for ix in mine]
            w.calls.store_interactions(tenant, items, now=now)
            w.interactions += items
        w.store_calls = len(by_tenant)
        if batch.feedback:
            w.parked, w.pending = self._queue_feedback(w.calls, batch.feedback, now)
        return w

    def apply(self, w: "_Writes") -> None:
        """Send a prepared batch's writes and finish what their answers ask for: feedback parked
        before its interaction, now drained, and feedback whose interaction was stored since
        `prepare` read it."""
        self._dead_letter(w.batch.dead)
        results = w.calls.execute()
        parked_lists = [parked for per_tenant in results[:w.store_calls] for parked in per_tenant]
        if w.interactions:
            metrics.EVENTS.labels(TOPIC_INTERACTIONS, "stored").inc(len(w.interactions))
            self._drain_parked(w.interactions, parked_lists, w.now)
        retry = self._feedback_done(w.parked, w.pending, results[w.store_calls:])
        self._store_feedback(retry)
        self.processed += w.batch.size
        metrics.EVENT_RATE.set(self.rate.add(w.batch.size))

    def _dead_letter(self, dead: list[DeadLetter]) -> None:
        if not dead:
            return
        if self._dlq is None:
            self._dlq = EventProducer(self.bootstrap, timeout_s=10.0)
        deliveries = []
        for d in dead:
            log.warning("dead letter from %s@%s:%s: %s", d.source_topic, d.source_partition, d.source_offset, d.reason)
            deliveries.append(self._dlq.send(TOPIC_DLQ, key=d.key or "", value=d.model_dump_json()))
        for delivery in deliveries:           # each durable before the offsets move on
            delivery.get(timeout=10.0)
        record_dead_letters(self.r, dead)
        metrics.DLQ.inc(len(dead))
        metrics.EVENTS.labels("any", "dead_letter").inc(len(dead))

    def _drain_parked(self, stored: list[InteractionWrite], parked_lists: list[list[bytes]], now: float) -> None:
        """Feedback that arrived before its interaction, handed back by the store script: apply
        it now (guarded by removal from the parked hash, so a second drain of the same feedback
        stores nothing)."""
        writes: dict[str, list[PendingWrite]] = defaultdict(list)
        for item, parked in zip(stored, parked_lists, strict=True):
            for body in parked:
                fb = FeedbackEvent.model_validate_json(body)
                # no recent-list entry: it was listed when it was parked
                writes[fb.tenant].append(self._pending(item.body, fb, "", parked_for=item.interaction_id))
        if writes:
            batch = self.buffers.batch()
            for tenant, items in writes.items():
                batch.add_many(tenant, items, now=now, capacity=self._capacity(tenant))
            self._note_depth_tenants(writes)
            flags = [stored for per_tenant in batch.execute() for stored in per_tenant]
            _count_untrained([item for items in writes.values() for item in items], flags)

    def _store_feedback(self, feedback: list[FeedbackEvent]) -> None:
        todo = feedback
        for _attempt in range(5):
            if not todo:
                return
            now = time.time()
            batch = self.buffers.batch()
            parked, pending = self._queue_feedback(batch, todo, now)
            todo = self._feedback_done(parked, pending, batch.execute())
        if todo:
            raise RuntimeError(f"{len(todo)} feedback records kept racing their interactions")

    def _queue_feedback(self, batch: BufferBatch, feedback: list[FeedbackEvent],
                        now: float) -> tuple[list[FeedbackEvent], list[PendingWrite]]:
        """Queue on `batch` the join of each score whose interaction is stored (one read for
        all), and the parking of the others; returns (parked, joined) in the order queued."""
        found = self.buffers.stored_interaction_bodies([(fb.tenant, fb.interaction_id) for fb in feedback])
        writes: dict[str, list[PendingWrite]] = defaultdict(list)
        parked: list[FeedbackEvent] = []
        for fb, stored in zip(feedback, found):
            if stored is None:
                parked.append(fb)
                continue
            writes[fb.tenant].append(self._pending(stored, fb, _recent(fb)))
        for fb in parked:
            batch.park_feedback(fb.tenant, fb.event_id, fb.interaction_id, fb.model_dump_json(),
                                now=now, recent=_recent(fb))
        for tenant, items in writes.items():
            batch.add_many(tenant, items, now=now, capacity=self._capacity(tenant))
        self._note_depth_tenants(writes)
        return parked, [item for items in writes.values() for item in items]

    def _feedback_done(self, parked: list[FeedbackEvent], pending: list[PendingWrite],
                       results: list) -> list[FeedbackEvent]:
        """Count what the park and add calls of `_queue_feedback` did (`results`: their answers in
        order); returns the feedback whose interaction arrived between the read and the park (to
        be joined again)."""
        park_results: list[ParkResult] = results[:len(parked)]
        add_results = [stored for flags in results[len(parked):] for stored in flags]
        _count_untrained(pending, add_results)
        stored = sum(add_results)
        metrics.EVENTS.labels(TOPIC_FEEDBACK, "stored").inc(stored)
        metrics.EVENTS.labels(TOPIC_FEEDBACK, "parked").inc(park_results.count(ParkResult.PARKED))
        metrics.EVENTS.labels(TOPIC_FEEDBACK, "duplicate").inc(
            len(add_results) - stored + park_results.count(ParkResult.DUPLICATE))
        return [fb for fb, res in zip(parked, park_results) if res == ParkResult.INTERACTION_STORED]

    def _pending(self, stored: str | bytes, fb: FeedbackEvent, recent: str,
                 parked_for: str | None = None) -> PendingWrite:
        """The write of `fb` joined with the interaction stored as `stored` (its JSON) under the
        tenant's reward spec."""
        spec = self._reward_spec(fb.tenant)
        return PendingWrite(fb.event_id, join_stored(stored, fb, spec), recent, parked_for=parked_for,
                            untrained=untrained_reason(fb, spec) or "")

    def _policy(self, tenant: str) -> LearningPolicy | None:
        """The tenant's learning policy (None: not in the registry), cached `POLICY_CACHE_S`."""
        now = time.monotonic()
        hit = self._policies.get(tenant)
        if hit is not None and hit.expires > now:
            return hit.policy
        try:
            policy = self.registry.get_tenant(tenant).policy
        except RegistryError:
            policy = None
        if len(self._policies) > 10_000:
            self._policies.clear()
        self._policies[tenant] = _CachedPolicy(policy, now + POLICY_CACHE_S)
        return policy

    def _capacity(self, tenant: str) -> int:
        """The tenant's buffer capacity (its policy, else the default)."""
        policy = self._policy(tenant)
        return (policy.buffer_capacity if policy is not None else None) or self.settings.buffer_capacity

    def _reward_spec(self, tenant: str) -> RewardSpec | None:
        """The tenant's reward spec (None: none, or no such tenant: every score trains as is)."""
        policy = self._policy(tenant)
        return policy.reward_spec if policy is not None else None


def _count_untrained(items: list[PendingWrite], stored: list[int]) -> None:
    """Count in Prometheus the scores of the events just stored (flag 1) that train nothing."""
    for item, flag in zip(items, stored, strict=True):
        if flag and item.untrained:
            metrics.UNTRAINED_FEEDBACK.labels(item.untrained).inc()


def _recent(fb: FeedbackEvent) -> str:
    return to_json({"event_id": fb.event_id, "interaction_id": fb.interaction_id, "time": fb.time,
                       "source": fb.source, "score": fb.score, "key": fb.key, "comment": fb.comment,
                       "correction": fb.correction.content if fb.correction else None}).decode()


def main(settings: IngestSettings, kafka_bootstrap: str, redis_url: str, client_id: str = "clora-ingest") -> None:
    """Entry point of `clora ingest-worker`: run until SIGTERM/SIGINT."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if settings.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(settings.metrics_port, addr=settings.metrics_host)
        except OSError as e:
            log.warning("metrics port %s busy (%s); this worker exports no metrics", settings.metrics_port, e)
    heartbeat = Heartbeat.from_env()
    heartbeat.start_watchdog(settings.stall_timeout_s)
    worker = IngestWorker(settings, kafka_bootstrap, redis_url, client_id=client_id, heartbeat=heartbeat)
    tune_gc()
    worker.run(stop)

"""Interaction logging off the request path: one `InteractionEvent` per served completion
goes to `clora.interactions`, keyed by tenant.

`InteractionLogger.submit` only enqueues and returns a future that resolves once the event is
durable: acknowledged by the broker, fsync'd to the spool, or set aside as refused for good.
The gateway waits for it before answering (`GatewaySettings.durable_interactions`), so a
crash of the serving process never loses an answered interaction.

Two threads. The sender takes batches off the queue and sends them to the broker, waiting for
acks=all; whatever the broker does not acknowledge in time is appended to the `DiskSpool`, and
while the spool holds anything, new events go straight there (so a tenant's events keep their
order, and a new event never waits on a broker that is known to be down). The drainer empties
the spool, oldest first, whenever it holds anything, retrying every `retry_s`: a drain
attempt against a frozen broker blocks only the drainer, never an answer. Nothing is dropped:
a record the broker refuses for good (too large, invalid) is set aside in the spool folder's
`rejected.jsonl` and counted, so that it does not hold up every later event; an unexpected
error keeps the batch for the next round instead of ending either thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable

from clora.ingest.producer import BrokerUnavailable, EventProducer, RecordRefused
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent
from clora.serving.spool import DiskSpool

log = logging.getLogger(__name__)

Record = tuple[str, str, str]  # (topic, key, value)
Pending = tuple[Record, cf.Future]
"""A queued record and the future `submit` returned for it (resolved once it is durable)."""

class InteractionLogger:
    def __init__(self, make_producer: Callable[[], EventProducer], spool: DiskSpool, *,
                 ack_timeout_s: float = 2.0, retry_s: float = 1.0, batch: int = 500):
        self._make_producer = make_producer
        self._producer: EventProducer | None = None
        self._producer_lock = threading.Lock()
        self.spool = spool
        self._spool_lock = threading.Lock()
        """Held for every spool operation: the sender appends while the drainer reads and acks."""
        self.ack_timeout_s = ack_timeout_s
        self.retry_s = retry_s
        self.batch = batch
        self._q: queue.Queue[Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="interaction-logger", daemon=True)
        self._drainer = threading.Thread(target=self._drain_loop, name="interaction-spool-drainer", daemon=True)
        self._spooled_event = threading.Event()
        """Set whenever the spool got records: wakes the drainer before its next retry."""
        self._stopping = threading.Event()
        """Set once the sender has finished: the drainer makes one last attempt and ends."""
        self._give_up = threading.Event()
        """Set by `stop` after its timeout: send nothing more, spool everything."""
        self._count_lock = threading.Lock()
        self.sent = 0
        self.spooled = 0
        self.rejected = 0

    def start(self) -> "InteractionLogger":
        self._thread.start()
        self._drainer.start()
        return self

    def submit(self, event: InteractionEvent) -> cf.Future:
        """Queue `event`; the future resolves (to None) once it is durable."""
        done: cf.Future = cf.Future()
        self._q.put(((TOPIC_INTERACTIONS, event.tenant, event.model_dump_json()), done))
        return done

    def queued(self) -> int:
        return self._q.qsize()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Flush what can be flushed; the rest stays in the spool for the next start. After
        `timeout_s` the broker is given up on: what is still queued goes to the spool."""
        deadline = time.monotonic() + timeout_s
        self._q.put(None)
        self._thread.join(timeout_s)
        self._stopping.set()
        self._spooled_event.set()
        self._drainer.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() or self._drainer.is_alive():
            self._give_up.set()
            self._thread.join()
            self._drainer.join()
        if self._producer is not None:
            self._producer.close()           # logs what it could not flush
        self.spool.close()

    # --- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        carry: list[Pending] = []  # a batch an unexpected error interrupted: it goes first next time
        stopping = False
        while not stopping:
            batch, stopping = self._take(carry)
            carry = []
            records = [record for record, _ in batch]
            try:
                if not records:
                    continue
                with self._spool_lock:
                    spooling = not self.spool.empty()
                    if spooling:  # the broker is behind: keep the order, do not wait on it
                        self._append(records)
                if not spooling and not self._send(records):
                    with self._spool_lock:
                        self._append(records)
                _durable(batch)
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                carry = batch  # neither sent nor spooled
                log.exception("logging %d interaction events failed; retrying in %.1f s", len(batch), self.retry_s)
                if stopping:
                    log.error("stopping with %d interaction events neither sent nor spooled", len(batch))
                    for _, done in batch:
                        done.set_exception(RuntimeError("the interaction logger stopped before this event was "
                                                        "sent or spooled"))
                else:
                    time.sleep(self.retry_s)

    def _take(self, carry: list[Pending]) -> tuple[list[Pending], bool]:
        """The next batch (after `carry`), and whether `stop` was asked. While the spool holds
        anything, everything queued goes at once (to the spool: a broker outage must not leave
        events waiting in memory)."""
        with self._spool_lock:
            spooling = not self.spool.empty()
        batch, limit = list(carry), max(self.batch, self._q.qsize()) if spooling else self.batch
        try:
            item = self._q.get(timeout=self.retry_s) if not batch else self._q.get_nowait()
            while True:
                if item is None:
                    return batch, True
                batch.append(item)
                if len(batch) >= limit:
                    return batch, False
                item = self._q.get_nowait()
        except queue.Empty:
            return batch, False

    def _append(self, batch: list[Record]) -> None:
        """Spool `batch` (the caller holds the spool lock) and wake the drainer."""
        self.spool.append(batch)
        self.spooled += len(batch)
        self._spooled_event.set()
        log.info("broker unavailable: spooled %d interaction events", len(batch))

    # --- the drainer thread -----------------------------------------------------------------

    def _drain_loop(self) -> None:
        while not self._give_up.is_set():
            self._spooled_event.wait(self.retry_s)
            self._spooled_event.clear()
            last = self._stopping.is_set()  # stop sets it before waking us: one last attempt
            try:
                self._drain_spool()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                log.exception("draining the interaction spool failed; retrying in %.1f s", self.retry_s)
            if last:
                return

    def _drain_spool(self) -> None:
        while not self._give_up.is_set():
            with self._spool_lock:
                records = self.spool.pending(self.batch) if not self.spool.empty() else []
            if not records:
                return
            if not self._send([(r.topic, r.key, r.value) for r in records]):
                return
            with self._spool_lock:
                self.spool.ack(records[-1].end)

    # --- both -------------------------------------------------------------------------------

    def _producer_now(self) -> EventProducer:
        with self._producer_lock:
            if self._producer is None:
                self._producer = self._make_producer()
            return self._producer

    def _send(self, batch: list[Record]) -> bool:
        """Send and wait for every ack. False (nothing assumed stored) if the broker failed. A
        record refused for good is set aside (`_reject`) and counts as handled."""
        if self._give_up.is_set():
            return False
        deadline = time.monotonic() + self.ack_timeout_s
        try:
            producer = self._producer_now()
            futures = []
            for record in batch:
                try:
                    futures.append((record, producer.send(*record)))
                except RecordRefused as e:     # no retry can store it: set aside, the rest flow
                    self._reject(record, e)
            for record, f in futures:
                try:
                    f.get(timeout=max(0.01, deadline - time.monotonic()))
                except RecordRefused as e:
                    self._reject(record, e)
        except BrokerUnavailable as e:
            log.warning("sending %d interaction events failed: %s", len(batch), e)
            return False
        with self._count_lock:
            self.sent += len(batch)
        return True

    def _reject(self, record: Record, error: BaseException) -> None:
        topic, key, value = record
        with self._spool_lock:
            self.spool.set_aside({"topic": topic, "key": key, "value": value, "error": repr(error)})
        with self._count_lock:
            self.rejected += 1
        log.error("the broker refused an interaction event of tenant %s for good (%s); set aside in %s",
                  key, error, self.spool.rejected_file)


def _durable(batch: list[Pending]) -> None:
    for _, done in batch:
        if not done.done():
            done.set_result(None)

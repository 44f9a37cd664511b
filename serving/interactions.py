"""Interaction logging off the request path: one `InteractionEvent` per served completion
goes to `clora.interactions`, keyed by tenant.

`InteractionLogger.submit` only enqueues (never blocks a response). A background thread
sends batches to the broker and waits for acks=all; whatever the broker does not acknowledge
in time is appended to the `DiskSpool`, and while the spool holds anything new events go
there too (so a tenant's events keep their order). The same thread retries the spool every
`retry_s` and empties it once the broker is back. Nothing is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kafka.errors import KafkaError

from clora.ingest.producer import BrokerUnavailable, EventProducer
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent
from clora.serving.spool import DiskSpool

log = logging.getLogger(__name__)

Record = tuple[str, str, str]  # (topic, key, value)


class InteractionLogger:
    def __init__(self, make_producer: Callable[[], EventProducer], spool: DiskSpool, *,
                 ack_timeout_s: float = 2.0, retry_s: float = 1.0, batch: int = 500):
        self._make_producer = make_producer
        self._producer: EventProducer | None = None
        self.spool = spool
        self.ack_timeout_s = ack_timeout_s
        self.retry_s = retry_s
        self.batch = batch
        self._q: queue.Queue[Record | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="interaction-logger", daemon=True)
        self._stopped = threading.Event()
        self.sent = 0
        self.spooled = 0

    def start(self) -> "InteractionLogger":
        self._thread.start()
        return self

    def submit(self, event: InteractionEvent) -> None:
        self._q.put((TOPIC_INTERACTIONS, event.tenant, event.model_dump_json()))

    def backlog(self) -> int:
        """Events not yet acknowledged by the broker (queued + spooled)."""
        return self._q.qsize() + self.spool.count()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Flush what can be flushed; the rest stays in the spool for the next start."""
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._producer is not None:
            try:
                self._producer.close()
            except KafkaError as e:
                log.warning("closing the interaction producer failed: %s", e)
        self.spool.close()

    # --- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch: list[Record] = []
            try:
                item = self._q.get(timeout=self.retry_s)
                while True:
                    if item is None:
                        stopping = True
                        break
                    batch.append(item)
                    if len(batch) >= self.batch:
                        break
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            if not self.spool.empty():
                self._append(batch)
                self._drain_spool()
            elif batch and not self._send(batch):
                self._append(batch)

    def _append(self, batch: list[Record]) -> None:
        if batch:
            self.spool.append(batch)
            self.spooled += len(batch)
            log.info("broker unavailable: spooled %d interaction events", len(batch))

    def _drain_spool(self) -> None:
        while not self.spool.empty():
            records = self.spool.pending(self.batch)
            if not records:
                return
            if not self._send([(r.topic, r.key, r.value) for r in records]):
                return
            self.spool.ack(records[-1].end)

    def _send(self, batch: list[Record]) -> bool:
        """Send and wait for every ack. False (nothing assumed stored) if the broker failed."""
        try:
            if self._producer is None:
                self._producer = self._make_producer()
            futures = [self._producer.send(t, k, v) for t, k, v in batch]
            for f in futures:
                f.get(timeout=self.ack_timeout_s)
        except (BrokerUnavailable, KafkaError) as e:
            log.warning("sending %d interaction events failed: %s", len(batch), e)
            return False
        self.sent += len(batch)
        return True

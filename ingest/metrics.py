"""Prometheus metrics of the ingest path (webhook and workers).

    clora_ingest_events_total{topic, outcome}   outcome: stored | duplicate | parked | dead_letter
    clora_ingest_events_per_second               over the last 10 s, for humans and dashboards
    clora_buffer_depth{tenant, kind}             examples in a tenant's replay buffer
    clora_consumer_lag{topic, partition}         high-water mark minus committed offset
    clora_dlq_total                              records sent to clora.dlq
    clora_feedback_untrained_total{reason}       scores stored but not trained on (reward spec):
                                                 unknown_key | untrusted_source | out_of_range
    clora_webhook_requests_total{status}         webhook answers by status code
    clora_webhook_feedback_pending_total         records accepted on an interaction id the gateway did not
                                                 serve: they wait (parked) for a client to record the
                                                 interaction, and expire unjoined if none does
"""

from __future__ import annotations

import collections
import time

from prometheus_client import Counter, Gauge

EVENTS = Counter("clora_ingest_events", "Events processed by ingest workers", ["topic", "outcome"])
EVENT_RATE = Gauge("clora_ingest_events_per_second", "Events processed per second over the last 10 s")
BUFFER_DEPTH = Gauge("clora_buffer_depth", "Examples in a tenant's replay buffer", ["tenant", "kind"])
CONSUMER_LAG = Gauge("clora_consumer_lag", "High-water mark minus committed offset", ["topic", "partition"])
DLQ = Counter("clora_dlq", "Records sent to the dead-letter topic")
UNTRAINED_FEEDBACK = Counter("clora_feedback_untrained", "Scores stored but not trained on: the tenant's reward "
                             "spec does not take them", ["reason"])
WEBHOOK = Counter("clora_webhook_requests", "Webhook answers", ["status"])
FEEDBACK_PENDING = Counter("clora_webhook_feedback_pending", "Feedback records accepted on an interaction id "
                           "the gateway did not serve, waiting for a client to record the interaction")
WEBHOOK_EVENTS = Counter("clora_webhook_events_accepted", "Feedback records acknowledged by the broker")


class RateMeter:
    """Events per second over a sliding window, updated in O(1) per batch."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._marks.append((now, n))
        self._total += n
        while self._marks and self._marks[0][0] < now - self.window_s:
            self._total -= self._marks.popleft()[1]
        return self._total / self.window_s

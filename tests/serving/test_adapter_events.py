"""`clora.adapters` events reach the hot swapper: a published event makes it reconcile that
tenant at once (the registry poll is only the safety net)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_ADAPTERS, AdapterEvent
from clora.serving.hotswap import AdapterEventListener

pytestmark = pytest.mark.integration


class RecordingSwapper:
    def __init__(self):
        self.tenants: list[str] = []
        self.retry_now: list[bool] = []

    async def reconcile(self, tenant: str, *, retry_now: bool = False) -> None:
        self.tenants.append(tenant)
        self.retry_now.append(retry_now)


def test_adapter_event_triggers_reconcile(stack, tenant_id):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    swapper = RecordingSwapper()
    listener = AdapterEventListener(stack.kafka_bootstrap, swapper, loop)
    listener.start()
    producer = EventProducer(stack.kafka_bootstrap)
    try:
        event = AdapterEvent(tenant=tenant_id, action="published", version=3, path="/adapters/x/v3",
                             base_model="tiny")
        deadline = time.monotonic() + 30
        while tenant_id not in swapper.tenants:  # resend until the consumer has its partitions
            assert time.monotonic() < deadline, "adapter event never reached the swapper"
            producer.send_sync(TOPIC_ADAPTERS, tenant_id, event.model_dump_json())
            time.sleep(0.5)
        time.sleep(1.0)  # let the resent copies still in flight arrive before counting
        n = swapper.tenants.count(tenant_id)  # counted before the next send, which may arrive at once
        producer.send_sync(TOPIC_ADAPTERS, tenant_id, b"not json")  # ignored, not fatal
        producer.send_sync(TOPIC_ADAPTERS, tenant_id, event.model_dump_json())
        deadline = time.monotonic() + 10
        while swapper.tenants.count(tenant_id) == n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert swapper.tenants.count(tenant_id) > n, "the listener died on an invalid record"
        assert all(swapper.retry_now)  # an event retries a version that failed to load at once
    finally:
        producer.close()
        listener.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

"""The Prometheus metrics of the ingest path carry real numbers: events/s, buffer depth per
tenant, consumer lag and the dead-letter count."""

from __future__ import annotations


import pytest
from prometheus_client import REGISTRY, generate_latest

from clora.ingest.metrics import RateMeter
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_FEEDBACK, TOPIC_INTERACTIONS, FeedbackEvent, FeedbackIn, InteractionEvent


def test_rate_meter_slides():
    m = RateMeter(window_s=10)
    assert m.add(50, now=0.0) == 5.0
    assert m.add(50, now=5.0) == 10.0
    assert m.add(0, now=12.0) == 5.0          # the first mark left the window


@pytest.mark.integration
def test_metrics_follow_the_stream(stack, ingest_worker, tenant_id, wait_for):
    producer = EventProducer(stack.kafka_bootstrap)
    for i in range(20):
        ix = InteractionEvent(tenant=tenant_id, interaction_id=f"m{i}", messages=[{"role": "user", "content": "q"}],
                              response={"role": "assistant", "content": "a"})
        producer.send(TOPIC_INTERACTIONS, tenant_id, ix.model_dump_json())
        fb = FeedbackEvent.accept(tenant_id, FeedbackIn(interaction_id=f"m{i}", score=1.0))
        producer.send(TOPIC_FEEDBACK, tenant_id, fb.model_dump_json())
    producer.send(TOPIC_FEEDBACK, tenant_id, b"garbage")
    producer.flush(10)
    producer.close()

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels)

    depth = lambda: (sample("clora_buffer_depth", tenant=tenant_id, kind="rl") or 0)
    # depth excludes the ~10% held out; wait for the gauge refresh (every 2 s)
    wait_for(lambda: depth() >= 12, timeout=30, what="buffer depth gauge")
    assert depth() <= 20
    assert sample("clora_ingest_events_per_second") > 0
    assert sample("clora_dlq_total") >= 1
    lag_samples = lambda: [s for m in REGISTRY.collect() if m.name == "clora_consumer_lag" for s in m.samples]
    lags = wait_for(lag_samples, timeout=30, what="lag gauges (the consumer loop's own, every 2 s)")
    assert all(s.value >= 0 for s in lags)
    wait_for(lambda: all(s.value == 0 for m in REGISTRY.collect() if m.name == "clora_consumer_lag"
                         for s in m.samples), timeout=30, what="lag to drain to 0")
    text = generate_latest().decode()
    assert f'clora_buffer_depth{{kind="rl",tenant="{tenant_id}"}}' in text

"""The learner on the real platform: corrections sent through the webhook, joined by an
ingest worker into the real Redis buffers, trained by the learner on a tiny model, published
as a PEFT folder, recorded in the registry, announced on `clora.adapters`, and plotted."""

from __future__ import annotations

import json

import httpx
import pytest

from clora.registry import LearningPolicy
from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_ADAPTERS, TOPIC_INTERACTIONS, AdapterEvent, InteractionEvent
from clora.learner.process import Learner
from clora.learner.settings import LearnerSettings
from tests.kafka_read import read_keyed

pytestmark = pytest.mark.integration


def test_corrections_through_the_platform_become_a_published_version(
        stack, registry, redis_client, webhook, ingest_worker, tiny, tenant_id, tmp_path, wait_for):
    policy = LearningPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4, min_new_examples=4)
    _, key = registry.create_tenant(tenant_id, policy=policy)
    producer = EventProducer(stack.kafka_bootstrap)
    n = 24
    for i in range(n):
        iid = f"{tenant_id}-{i}"
        registry.claim_interaction(iid, tenant_id)
        ev = InteractionEvent(tenant=tenant_id, interaction_id=iid, messages=[{"role": "user", "content": f"color {i}?"}],
                              response={"role": "assistant", "content": "red"})
        producer.send(TOPIC_INTERACTIONS, tenant_id, ev.model_dump_json())
    producer.flush(10)
    records = [{"interaction_id": f"{tenant_id}-{i}", "source": "operator",
                "correction": {"role": "assistant", "content": "blue"}} for i in range(n)]
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers={"Authorization": f"Bearer {key}"},
                   json={"records": records}, timeout=60)
    assert r.status_code == 202
    buf = ReplayBuffer(redis_client)
    wait_for(lambda: buf.depth(tenant_id, "sft") + buf.depth(tenant_id, "sft", heldout=True) == n,
             what="24 sft examples in the buffer")

    model, tok = tiny
    settings = LearnerSettings(adapters_dir=tmp_path / "adapters", checkpoints_dir=tmp_path / "ckpt",
                               metrics_port=0, rank=4, alpha=8)
    announced: list[AdapterEvent] = []

    def announce(ev: AdapterEvent) -> None:
        announced.append(ev)
        producer.send_sync(TOPIC_ADAPTERS, ev.tenant, ev.model_dump_json())

    learner = Learner(settings, model, tok, registry=registry, buffer=buf, announce=announce, base_model_name="tiny")
    # other tests' tenants share this Redis and may have examples waiting too: tick until this
    # tenant's turn comes (the scheduler serves every waiting tenant within a few ticks)
    trained = []
    while tenant_id not in trained and len(trained) < 20:
        trained.append(learner.tick())
    assert tenant_id in trained, trained
    learner.shutdown()
    producer.close()

    live = registry.live_version(tenant_id)
    assert live is not None and live >= 1
    version = registry.adapter_version(tenant_id, live)
    folder = tmp_path / "adapters" / tenant_id / f"v{live}"
    assert version.path == str(folder.resolve())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    lo, hi = version.feedback_window
    assert lo <= hi and version.examples_seen >= 4
    history = registry.metrics_history(tenant_id)
    assert any(p.get("loss") is not None for p in history)
    on_topic = [json.loads(v) for v in read_keyed(stack.kafka_bootstrap, TOPIC_ADAPTERS, tenant_id,
                                                  lambda vs: len(vs) >= len(announced))]
    assert {e["version"] for e in on_topic} == {e.version for e in announced} and live in {e["version"] for e in on_topic}
    assert all(e["action"] == "published" and e["tenant"] == tenant_id for e in on_topic)

"""A `clora up` platform in the test process, on free ports under a temporary data dir, with
short supervision limits; and streams of events for it. Shared by test_supervision.py and
test_chaos.py."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest

from clora.infra.platform import Platform
from clora.infra.settings import SupervisorSettings
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent
from clora.procs import free_port
from clora.settings import PlatformSettings

FAST = SupervisorSettings(liveness_interval_s=0.5, unresponsive_after_s=5.0, broker_unresponsive_after_s=10.0,
                          lag_interval_s=0.5, ingest_stalled_after_s=15.0)
"""Supervision limits short enough for a test, long enough for a group join on a busy machine."""


@contextlib.contextmanager
def running_platform(data: Path, services: list[str], supervision: SupervisorSettings = FAST, **env: str):
    """A started `Platform` with `services` besides the broker and Redis; `env` adds CLORA_*
    settings (read by this process and inherited by the children)."""
    settings = {"CLORA_BROKER_PORT": str(free_port()), "CLORA_REDIS_PORT": str(free_port()),
                "CLORA_WEBHOOK_PORT": str(free_port()), "CLORA_CONSOLE_PORT": str(free_port()),
                "CLORA_INGEST_METRICS_PORT": "0", "CLORA_INGEST_GROUP_ID": f"g-{uuid.uuid4().hex[:6]}",
                "CLORA_INGEST_BUFFER_CAPACITY": "100000", **env}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CLORA_KAFKA_BOOTSTRAP", "CLORA_REDIS_URL"):
            mp.delenv(name, raising=False)
        for name, value in settings.items():
            mp.setenv(name, value)
        platform = Platform(PlatformSettings(data_dir=data, services=services), supervision=supervision)
        with platform:
            yield platform


def interaction(tenant: str, i: int) -> InteractionEvent:
    return InteractionEvent(tenant=tenant, interaction_id=f"i{i}", event_id=f"ix{i}",
                            messages=[{"role": "user", "content": f"q{i}"}],
                            response={"role": "assistant", "content": f"a{i}"})


def send_interactions(bootstrap: str, tenant: str, ids: range) -> None:
    """Interactions `ids`, each acknowledged by the broker (acks=all) before this returns."""
    producer = EventProducer(bootstrap, timeout_s=30)
    try:
        for i in ids:
            producer.send(TOPIC_INTERACTIONS, tenant, interaction(tenant, i).model_dump_json())
        producer.flush(60)
    finally:
        producer.close()


def pids_alive(*pids: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive

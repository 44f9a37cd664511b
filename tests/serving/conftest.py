"""Serving test fixtures: one tiny base model, a pool of PEFT adapters, and ONE engine +
gateway (`serving`) started per test session (vLLM takes tens of seconds to start).

Tenants get adapter versions through `tenants.create`, which copies a pool adapter into a fresh
folder per version (a version's folder is never reused) and records it in the registry.

A test that breaks what the session shares (kills a replica, freezes the broker) is marked
`disrupts_shared_stack`; `pytest_collection_modifyitems` runs those after every other test.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import importlib.util

import pytest

_spec = importlib.util.spec_from_file_location("clora_serving_tiny", Path(__file__).with_name("tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

POOL_SEEDS = (11, 12, 13, 14, 15, 16)
DISRUPTS = "disrupts_shared_stack"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{DISRUPTS}: breaks the session's shared engine or broker (it recovers "
                            "them, but runs after every other test)")


def pytest_collection_modifyitems(session, config, items):
    """Move the tests marked `disrupts_shared_stack` after all others, keeping each group's order."""
    items.sort(key=lambda item: item.get_closest_marker(DISRUPTS) is not None)   # a stable sort


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tiny.make_model(tmp_path_factory.mktemp("serving-models") / "base")


@pytest.fixture(scope="session")
def adapter_pool(model_dir, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("adapter-pool")
    return {s: tiny.make_adapter(model_dir, root / f"seed{s}", seed=s) for s in POOL_SEEDS}


@pytest.fixture(scope="session")
def serving(stack, model_dir, adapter_pool, tmp_path_factory):
    from clora.procs import free_port
    from clora.serving.service import ServingService
    from clora.serving.settings import EngineSettings, GatewaySettings

    data = tmp_path_factory.mktemp("serving")
    svc = ServingService(
        EngineSettings(model=str(model_dir), ports=[free_port()], max_loras=4, max_cpu_loras=6,
                       max_lora_rank=8, max_model_len=512, max_num_seqs=32, log_dir=data / "logs",
                       start_timeout_s=400, health_interval_s=0.5, keep_alive_s=8),
        GatewaySettings(port=0, metrics_port=0, spool_dir=data / "spool", tenant_concurrency=8, tenant_rate_per_s=1000,
                        tenant_burst=1000, registry_poll_s=0.2,
                        tenant_refresh_s=1.0, drain_timeout_s=60, kafka_timeout_s=2.0),
        kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url,
    ).start()
    yield svc
    svc.stop()


class Tenants:
    """Creates tenants with adapter versions copied from the pool."""

    def __init__(self, registry, pool: dict[int, Path], root: Path):
        self.registry, self.pool, self.root = registry, pool, root

    def create(self, *seeds: int, live: int | None = -1) -> tuple[str, str]:
        """A tenant with one version per seed (v1, v2, ...); the last is live unless `live` says."""
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        _, key = self.registry.create_tenant(tenant)
        for seed in seeds:
            self.publish(tenant, seed, make_live=False)
        if seeds and live is not None:
            self.registry.set_live_version(tenant, len(seeds) if live == -1 else live)
        return tenant, key

    def publish(self, tenant: str, seed: int, *, make_live: bool = True) -> int:
        from clora.registry import AdapterVersion

        versions = self.registry.adapter_versions(tenant)
        version = versions[-1].version + 1 if versions else 1
        folder = self.root / tenant / f"v{version}"
        shutil.copytree(self.pool[seed], folder)
        self.registry.record_adapter_version(
            tenant, AdapterVersion(version=version, path=str(folder), base_model="tiny", step=version))
        if make_live:
            self.registry.set_live_version(tenant, version)
        return version


@pytest.fixture(scope="session")
def tenants(redis_client, adapter_pool, tmp_path_factory) -> Tenants:
    from clora.registry import Registry

    return Tenants(Registry(redis_client), adapter_pool, tmp_path_factory.mktemp("tenant-adapters"))


@pytest.fixture
def client_for(serving):
    from openai import OpenAI

    def make(key: str, **kw):
        return OpenAI(base_url=serving.url, api_key=key, max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    return make


@pytest.fixture
def interactions(stack):
    """`interactions(ids, timeout_s)` -> {interaction id: event dict} read back from Kafka."""
    return lambda wanted, timeout_s=30.0: read_interactions(stack.kafka_bootstrap, set(wanted), timeout_s)


def read_interactions(bootstrap: str, wanted: set[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """Read `clora.interactions` from the start until every wanted interaction id is found."""
    from kafka import KafkaConsumer, TopicPartition

    from clora.ingest.schemas import TOPIC_INTERACTIONS

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             request_timeout_ms=10_000)
    found: dict[str, dict] = {}
    try:
        parts = [TopicPartition(TOPIC_INTERACTIONS, p) for p in consumer.partitions_for_topic(TOPIC_INTERACTIONS)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not wanted <= found.keys():
            for batch in consumer.poll(timeout_ms=500).values():
                for rec in batch:
                    ev = json.loads(rec.value)
                    if ev["interaction_id"] in wanted:
                        found[ev["interaction_id"]] = ev
    finally:
        consumer.close()
    return found

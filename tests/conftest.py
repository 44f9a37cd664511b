"""Shared fixtures: the real embedded broker and Redis, started once per test session, and the
fake OpenAI server and fake webhook (tests/fakes.py) the agents and infra unit tests talk to.

`stack` starts Tansu and redis-server on free ports under a temporary data dir (or uses
CLORA_KAFKA_BOOTSTRAP / CLORA_REDIS_URL when set). Tests isolate themselves by tenant id
(`tenant_id` fixture), never by flushing state another test may be reading.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("CLORA_TEST_ARTIFACTS", "test-artifacts"))


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from clora.infra.settings import BrokerSettings, RedisSettings
    from clora.settings import PlatformSettings
    from clora.infra.stack import LocalStack
    from clora.procs import free_port
    from clora.ingest.producer import ensure_topics

    data = tmp_path_factory.mktemp("clora-data")
    s = LocalStack(
        platform=PlatformSettings(data_dir=data),
        broker=BrokerSettings(port=free_port()),
        redis=RedisSettings(port=free_port()),
    )
    s.start()
    ensure_topics(s.kafka_bootstrap, partitions=s.broker.partitions)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_client(stack):
    import redis

    client = redis.Redis.from_url(stack.redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto in server mode, on a free port) for the whole session;
    yields its endpoint URL. Tests isolate themselves by bucket (`s3_storage_settings`)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_storage_settings(s3):
    """`StorageSettings` of a fresh bucket of the `s3` server, created here."""
    import boto3

    from clora.storage import StorageSettings

    settings = StorageSettings(backend="s3", s3_endpoint_url=s3, s3_bucket=f"clora-{uuid.uuid4().hex[:12]}",
                               s3_region="us-east-1", s3_access_key_id="test", s3_secret_access_key="test",
                               s3_max_attempts=1, s3_timeout_s=10)
    boto3.client("s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=settings.s3_bucket)
    return settings


@pytest.fixture
def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def registry(redis_client):
    from clora.registry import Registry

    return Registry(redis_client)


# --- ingest path: the webhook over real HTTP and one ingest worker, both in-process ----------

@pytest.fixture(scope="session")
def webhook(stack):
    """The feedback webhook wired to the real broker and Redis (2 s ack timeout)."""
    import redis

    from clora.registry import Registry
    from clora.ingest.settings import WebhookSettings
    from tests.fakes import ServerThread
    from clora.ingest.producer import EventProducer
    from clora.ingest.webhook import create_app

    settings = WebhookSettings(ack_timeout_s=2.0, max_body_bytes=64 * 1024, max_batch=500, auth_cache_s=0.5)
    producer = EventProducer(stack.kafka_bootstrap, timeout_s=settings.ack_timeout_s)
    from clora.ingest.webhook import async_redis_client

    app = create_app(settings, Registry(redis.Redis.from_url(stack.redis_url)), producer,
                     async_redis=async_redis_client(stack.redis_url))
    with ServerThread(app, lifespan="auto") as server:
        server.settings = settings
        yield server


@pytest.fixture(scope="session")
def ingest_worker(stack):
    """One ingest worker (its own consumer group) running for the whole session."""
    import threading

    from clora.ingest.settings import IngestSettings
    from clora.ingest.worker import IngestWorker

    worker = IngestWorker(IngestSettings(group_id=f"test-{uuid.uuid4().hex[:6]}", metrics_port=0),
                          stack.kafka_bootstrap, stack.redis_url)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    yield worker
    stop.set()
    thread.join(15)


@pytest.fixture
def wait_for():
    return _wait_for


def _wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; returns its value or fails the test naming `what`."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last value: {value!r})")
        time.sleep(interval)


@pytest.fixture(scope="session")
def console(stack):
    """The control-plane API + console over real HTTP, with the real broker and Redis."""
    import redis

    from clora.infra.control import create_control_app
    from tests.fakes import ServerThread
    from clora.registry import Registry
    from clora.ingest.buffers import ReplayBuffer
    from clora.ingest.producer import EventProducer

    client = redis.Redis.from_url(stack.redis_url)
    producer = EventProducer(stack.kafka_bootstrap)
    token = "test-admin-" + uuid.uuid4().hex
    app = create_control_app(Registry(client), ReplayBuffer(client), token, publish=producer.send_sync)
    with ServerThread(app, lifespan="auto") as server:
        server.token = token
        yield server
    producer.close()


# --- fakes for unit tests: one fake OpenAI server and one fake webhook per session -------------
# (tests/fakes.py), reset before each test that uses them

@pytest.fixture(scope="session")
def _openai_server():
    from tests.fakes import FakeOpenAI, ServerThread

    fake = FakeOpenAI()
    server = ServerThread(fake.app).start()
    fake.url = server.url
    yield fake
    server.stop()


@pytest.fixture
def fake_openai(_openai_server):
    _openai_server.requests.clear()
    _openai_server.response_ids.clear()
    _openai_server.fail_next = 0
    _openai_server.policy = lambda body, i: "I don't know."
    return _openai_server


@pytest.fixture
def openai_client(fake_openai):
    import openai

    client = openai.OpenAI(base_url=fake_openai.url + "/v1", api_key="key-1", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture(scope="session")
def _webhook_server():
    from tests.fakes import FakeWebhook, ServerThread

    fake = FakeWebhook()
    server = ServerThread(fake.app).start()
    fake.url = server.url
    yield fake
    server.stop()


@pytest.fixture
def fake_webhook(_webhook_server):
    _webhook_server.script.clear()
    _webhook_server.attempts.clear()
    _webhook_server.accepted.clear()
    return _webhook_server

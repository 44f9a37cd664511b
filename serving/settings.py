"""Settings of the serving side: the vLLM engine replicas (`EngineSettings`, env prefix
`CLORA_ENGINE_`) and the OpenAI-compatible gateway (`GatewaySettings`, `CLORA_GATEWAY_`).
One pydantic settings model per service, built with `clora.settings.settings_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings

from clora.settings import settings_config


class EngineSettings(BaseSettings):
    """The vLLM OpenAI server processes (one per replica) that hold the base model and LoRAs."""

    model_config = settings_config("CLORA_ENGINE_")

    model: str = ".clora/models/smollm2-135m-instruct"
    """Local HF model directory of the frozen base model."""
    base_name: str = "base"
    """Name clients use for the base model (vLLM `--served-model-name`)."""
    host: str = "127.0.0.1"
    """`CLORA_ENGINE_HOST`: the address the local vLLM replicas bind, and the gateway reaches them at."""
    ports: list[int] = Field(default_factory=lambda: [8100])
    """One local vLLM replica (a child process the engine manager starts and restarts) per port.
    Default: [8100], or none when `remote_urls` are set; [] starts none."""
    remote_urls: list[str] = Field(default_factory=list)
    """`CLORA_ENGINE_REMOTE_URLS`, a JSON list: vLLM servers started elsewhere (GPU `vllm serve`
    with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), attached by base URL, e.g.
    `["http://vllm-0.vllm:8000"]`. Never started or restarted here: one that fails its health check
    leaves rotation and comes back when it answers again. Each must see adapter folders at the
    paths the gateway loads them from (`CLORA_STORAGE_CACHE_DIR` on a shared volume)."""
    remote_api_key: SecretStr | None = None
    """`CLORA_ENGINE_REMOTE_API_KEY`: sent as `Authorization: Bearer` to every remote replica (their
    `VLLM_API_KEY`). Local replicas get a key generated per run."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """float32 on CPU: bf16 LoRA output drifts from PEFT."""
    max_loras: int = Field(default=4, ge=1, le=256)
    """Adapters that can share one batch (vLLM `--max-loras`)."""
    max_cpu_loras: int = Field(default=8, ge=1, le=4096)
    """Adapters one replica keeps in memory (vLLM `--max-cpu-loras`). Unless `max_registered_loras`
    is larger, also the adapters resident in it: the gateway evicts the least recently used idle
    one beyond this and reloads (and verifies) it on demand."""
    max_registered_loras: int | None = Field(default=256, ge=1, le=65536)
    """Adapters resident in one replica (loaded: vLLM serves their names), when more than
    `max_cpu_loras`: vLLM then keeps the `max_cpu_loras` used last in memory and re-reads another
    one's folder itself when a request needs it, with no unload, load or canary from the gateway
    (each version's folder never changes). Beyond this the gateway evicts as above. A resident
    adapter beyond vLLM's memory costs only its name in vLLM's table, and serving 4x more adapters
    than `max_cpu_loras` this way kept in-cache throughput where the gateway's own swapping lost
    20-50% (`clora bench tenants`). Default 256, or `max_cpu_loras` when that is larger; None:
    `max_cpu_loras` (the gateway does all the swapping)."""
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    max_model_len: int = Field(default=2048, ge=64)
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int | None = None
    kvcache_space_gib: int = Field(default=1, ge=1)
    """`VLLM_CPU_KVCACHE_SPACE` (CPU backend only)."""
    reserved_cpus: int = Field(default=0, ge=0)
    """`VLLM_CPU_NUM_OF_RESERVED_CPU` (CPU backend only)."""
    keep_alive_s: int = Field(default=60, ge=2)
    """How long a replica keeps an idle HTTP connection open (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`).
    The gateway drops its own idle connections at half of it: a client that reuses a connection
    the server is closing at the same moment gets a reset. With vLLM's default and httpx's
    (5 s each) that race failed a request now and then."""
    tool_call_parser: str = "hermes"
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which logprobs vLLM returns (and interaction events carry)."""
    cpu_lora_ops: Literal["clora", "vllm"] = "clora"
    """CPU build only: "clora" starts replicas with the hook of `clora.serving.vllm_launch`,
    which swaps in grouped LoRA ops (`serving/vllm_cpu_lora.py`: faster multi-LoRA, base rows stay base);
    "vllm" keeps vLLM's own ops."""
    shm_poll_s: float | None = Field(default=None, ge=0, le=0.1)
    """The longest a replica process waiting on another's shared-memory queue (the EngineCore on
    its worker's step, the worker on the next step) blocks between checks of it, woken early by
    the writer's ping, where vLLM yields and checks in a loop (`clora.serving.vllm_launch`).
    None: 0.002 on a CPU build, where the yielding EngineCore took a third of a core from the
    model and the learner; vLLM's own loop on a GPU."""
    base_via_zero_adapter: bool | None = None
    """Serve base-model requests through an all-zero adapter (see `serving/zero_adapter.py`:
    works around vLLM's CPU LoRA ops applying the last slot's adapter to base rows in mixed
    batches). None: on when running vLLM's own CPU ops (`cpu_lora_ops="vllm"` without CUDA)."""
    extra_args: list[str] = Field(default_factory=list)
    start_timeout_s: float = Field(default=300.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    hang_timeout_s: float = Field(default=60.0, gt=0)
    """A live replica that has not answered a health check for this long is restarted."""
    restart: bool = True
    """Restart a local replica that died or stopped answering health checks."""
    resident_slack: int = Field(default=4, ge=0)
    """Routing: a request goes to a replica where its adapter is resident unless that replica has
    this many more requests in flight than the least loaded one (which then loads it)."""
    adapter_retry_s: float = Field(default=30.0, gt=0)
    """A replica that failed to load a version, or whose canary (`clora.canary`) did not match,
    is out of rotation for that version for this long, doubling with each failure up to
    `adapter_retry_max_s`; then the next request or hot swap tries it again."""
    adapter_retry_max_s: float = Field(default=600.0, gt=0)
    canary_every_load: bool = False
    """Run the canary on every load. Off: once per version and replica between restarts (a
    version's folder never changes, so re-loading it after an eviction loads the same weights)."""
    canary_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a canary request (one token, the prompt's log-probabilities) may take."""
    log_dir: Path = Path(".clora/logs")

    @property
    def registered_loras(self) -> int:
        """Adapters resident in one replica at most (`max_registered_loras`, else `max_cpu_loras`)."""
        return self.max_registered_loras or self.max_cpu_loras

    @property
    def replica_count(self) -> int:
        """Local and remote replicas together."""
        return len(self.ports) + len(self.remote_urls)

    @field_validator("remote_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        out = []
        for url in urls:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.strip("/"):
                raise ValueError(f"{url!r} is not a vLLM server's base URL (http(s)://host:port, no path)")
            out.append(url.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError(f"a remote replica is listed twice: {urls}")
        return out

    @model_validator(mode="after")
    def _replicas(self) -> "EngineSettings":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if "max_registered_loras" not in self.model_fields_set and self.max_registered_loras is not None:
            self.max_registered_loras = max(self.max_registered_loras, self.max_cpu_loras)   # the default
        if self.max_registered_loras is not None and self.max_registered_loras < self.max_cpu_loras:
            raise ValueError(f"max_registered_loras ({self.max_registered_loras}) must be >= max_cpu_loras "
                             f"({self.max_cpu_loras}): vLLM caches only resident adapters")
        if "ports" not in self.model_fields_set and self.remote_urls:
            self.ports = []          # remote replicas only, unless local ones are asked for too
        if not self.replica_count:
            raise ValueError("no engine replica: ports is empty and remote_urls lists none")
        if self.adapter_retry_max_s < self.adapter_retry_s:
            raise ValueError(f"adapter_retry_max_s ({self.adapter_retry_max_s}) must be >= adapter_retry_s "
                             f"({self.adapter_retry_s})")
        return self


class GatewaySettings(BaseSettings):
    """The OpenAI-compatible gateway in front of the engine replicas."""

    model_config = settings_config("CLORA_GATEWAY_")

    host: str = "127.0.0.1"
    """`CLORA_GATEWAY_HOST`: the address the gateway binds (`0.0.0.0` in a container); its health
    check, `GET /health`, answers on the same port."""
    port: int = Field(default=8000, ge=0, le=65535)
    metrics_port: int | None = Field(default=9403, ge=0, le=65535)
    """Prometheus metrics on `metrics_host` (0: any free port; None: none)."""
    metrics_host: str = "127.0.0.1"
    """`CLORA_GATEWAY_METRICS_HOST`: the address the Prometheus endpoint binds (`0.0.0.0` for a
    scraper outside the container or host; the metrics name tenants, so keep it off public networks)."""
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    """Larger request bodies answer 413."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """Largest `max_tokens` a request may ask for (more answers 400)."""
    max_n: int = Field(default=16, ge=1)
    """Largest `n` a request may ask for; capped by the tenant's engine share (`tenant_limits`)."""
    tenant_concurrency: int = Field(default=32, ge=1)
    """Requests one tenant may have in flight; more answer 429. Capped by the tenant's engine
    share (`tenant_limits`)."""
    tenant_engine_share: float = Field(default=0.5, gt=0, le=1)
    """Share of the engine's sequence slots (replicas x `EngineSettings.max_num_seqs`) one tenant's
    requests in flight may hold, counting `n` sequences per request; more answer 429."""
    tenant_pinned_versions: int = Field(default=2, ge=1)
    """Versions other than its live one (`acme@v3`) one tenant may have requests in flight to at
    once; a request to yet another answers 429. Each such version holds an adapter slot."""
    tenant_rate_per_s: float = Field(default=50.0, gt=0)
    """Sustained requests per second per tenant; more answer 429. Counted as `tenant_burst`
    requests per sliding window of `ceil(tenant_burst / tenant_rate_per_s)` s (`serving/quota.py`)."""
    tenant_burst: int = Field(default=100, ge=1)
    shared_quotas: bool = True
    """Count every per-tenant limit (requests, sequences and pinned versions in flight,
    requests/s, recorded bytes/s) in Redis, the registry's, so that each is the tenant's total
    across every gateway instance. Off: in this process's memory, each gateway enforcing every
    limit on its own (for a single gateway). When Redis fails the gateway counts locally until
    it answers again (`serving/quota_store.py`)."""
    quota_lease_s: float = Field(default=30.0, ge=1)
    """A request's slot in Redis expires this long after its gateway last renewed it (every
    third of it while the request runs): a gateway killed with requests in flight frees their
    slots within this time."""
    quota_store_timeout_s: float = Field(default=0.5, gt=0)
    """Longest a quota check waits for Redis before it is made locally."""
    quota_store_retry_s: float = Field(default=5.0, gt=0)
    """After Redis failed a quota check, checks are made locally for this long before Redis is
    tried again."""
    max_json_depth: int = Field(default=32, ge=2, le=256)
    """Deepest nesting of objects and arrays in any request field (`tools`' JSON schemas
    included); deeper answers 400 naming the field."""
    max_recorded_bytes: int = Field(default=262_144, ge=1024)
    """Largest `messages` and largest `tools` (each, as JSON) a request may carry: both are
    recorded in its interaction event. Larger answers 400 naming the field."""
    tenant_recorded_bytes_per_s: int = Field(default=1_048_576, ge=1)
    """Bytes of recorded messages and tools one tenant may send per second, averaged over
    `tenant_recorded_burst_s` (a sliding window kept in Redis); more answer 429."""
    tenant_recorded_burst_s: int = Field(default=10, ge=1)
    durable_interactions: bool = True
    """Answer a completion only once its interaction event is acknowledged by the broker or
    fsync'd to the spool (a stream: before its `[DONE]`), so that no crash loses an answered
    one. Off: answer at once and send the event in the background."""
    record_timeout_s: float = Field(default=30.0, gt=0)
    """Longest an answer waits for its interaction event to be durable; past it the request
    answers 503 (`interaction_not_recorded`)."""
    spool_dir: Path = Path(".clora/spool/serving")
    """Interaction events the broker did not take are appended (fsync'd) here and resent."""
    kafka_timeout_s: float = Field(default=2.0, gt=0)
    registry_poll_s: float = Field(default=0.25, gt=0)
    """How often the live version of known tenants is re-read (hot swap trigger)."""
    tenant_refresh_s: float = Field(default=5.0, gt=0)
    """How often the full tenant list is re-read to discover new tenants."""
    drain_timeout_s: float = Field(default=600.0, gt=0)
    """Longest an old version waits for its in-flight requests before it is unloaded anyway."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    adapter_wait_s: float = Field(default=30.0, gt=0)
    """Longest a request waits for an engine slot when every resident adapter is busy."""
    fair_admission: bool = True
    """Send requests to the engine in weighted fair order over tokens across tenants, queueing
    beyond `fair_sequences` in flight (`serving/fair_queue.py`). Off: straight to vLLM, first come
    first served, so a tenant offering 10x the load gets ~10x the tokens."""
    fair_sequences: int | None = Field(default=None, ge=1)
    """Engine sequences this gateway keeps in flight across all tenants with `fair_admission`
    (None: replicas x `EngineSettings.max_num_seqs`, what the engine runs at once). With several
    gateways, each one's share of that."""
    fair_shares: bool = False
    """With `fair_admission`: also keep each tenant that has requests waiting within its weighted
    share of the engine's sequences while others want theirs (`serving/fair_queue.py`). Off: fair
    order only. On, `clora bench fairness` measured Jain 0.959 over 5-minute windows at 0.82x of
    first come first served's throughput (docs/results.md)."""
    fair_grace_s: float = Field(default=0.0, ge=0)
    """With `fair_shares`: how long after one of a tenant's requests ends it still counts as
    wanting its share (its clients sending the next request), so that another tenant's long
    requests do not take the slot meanwhile; the slot idles that long at most. 0: a tenant counts
    only while it has requests waiting, and no slot is held idle. At 0.25 s the bench measured
    Jain 0.974 at 0.71x throughput."""
    fair_wait_s: float = Field(default=600.0, gt=0)
    """Longest a request waits in the fair queue; past it the request answers 503 with a
    `retry-after`."""
    engine_report_s: float = Field(default=5.0, gt=0)
    """How often the gateway writes its replicas' state (health, resident adapters, adapters out
    of rotation and why) to the registry, where the console reads it."""
    freshness_tenant_labels: int = Field(default=100, ge=1)
    """Tenants the `clora_feedback_to_served_seconds` histogram names, the first observed first;
    every later tenant's observations share the label `_other`, which bounds its series."""

    @model_validator(mode="after")
    def _recorded_budget_admits_one_request(self) -> "GatewaySettings":
        budget = self.tenant_recorded_bytes_per_s * self.tenant_recorded_burst_s
        if budget < 2 * self.max_recorded_bytes:
            raise ValueError(f"tenant_recorded_bytes_per_s x tenant_recorded_burst_s ({budget}) must be >= 2 x "
                             f"max_recorded_bytes ({2 * self.max_recorded_bytes}): the largest request (messages "
                             "and tools) could never be admitted")
        return self


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold of the engine at once, derived from both settings by
    `tenant_limits`. Example: 2 replicas x `max_num_seqs` 32 and `tenant_engine_share` 0.25
    give `sequences` 16, so `n` <= 16 and at most 16 requests of n=1 (or 2 of n=8) in flight."""

    sequences: int
    """Sequences in flight (the sum of `n` over the tenant's requests)."""
    requests: int
    """Requests in flight: `tenant_concurrency`, at most `sequences`."""
    n: int
    """Largest `n`: `max_n`, at most `sequences`."""
    max_tokens: int
    """Largest `max_tokens`: `max_tokens_limit`, at most the engine's `max_model_len`."""


def tenant_limits(engine: EngineSettings, gateway: GatewaySettings) -> TenantLimits:
    """Derive a tenant's caps from the engine it shares; raises ValueError when its share of
    the engine's sequence slots is less than one sequence."""
    slots = engine.replica_count * engine.max_num_seqs
    sequences = int(slots * gateway.tenant_engine_share)
    if sequences < 1:
        raise ValueError(f"tenant_engine_share {gateway.tenant_engine_share} of the engine's {slots} sequence slots "
                         f"({engine.replica_count} replicas x max_num_seqs {engine.max_num_seqs}) leaves a tenant no "
                         "sequence")
    return TenantLimits(sequences=sequences, requests=min(gateway.tenant_concurrency, sequences),
                        n=min(gateway.max_n, sequences), max_tokens=min(gateway.max_tokens_limit, engine.max_model_len))

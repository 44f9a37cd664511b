"""Settings of the serving side: the vLLM engine replicas (`EngineSettings`, env prefix
`CLORA_ENGINE_`) and the OpenAI-compatible gateway (`GatewaySettings`, `CLORA_GATEWAY_`).
One pydantic settings model per service, built with `clora.settings.settings_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
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
    ports: list[int] = Field(default_factory=lambda: [8100], min_length=1)
    """One vLLM replica per port."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """float32 on CPU: bf16 LoRA output drifts from PEFT."""
    max_loras: int = Field(default=4, ge=1, le=256)
    """Adapters that can share one batch (vLLM `--max-loras`)."""
    max_cpu_loras: int = Field(default=8, ge=1, le=4096)
    """Adapters resident in one replica (vLLM `--max-cpu-loras`); the gateway evicts the least
    recently used idle one beyond this and reloads it on demand."""
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
    """Restart a replica that died or stopped answering health checks."""
    log_dir: Path = Path(".clora/logs")

    @model_validator(mode="after")
    def _cpu_loras_cover_batch(self) -> "EngineSettings":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


class GatewaySettings(BaseSettings):
    """The OpenAI-compatible gateway in front of the engine replicas."""

    model_config = settings_config("CLORA_GATEWAY_")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    metrics_port: int | None = Field(default=9403, ge=0, le=65535)
    """Prometheus metrics on 127.0.0.1 (0: any free port; None: none)."""
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    """Larger request bodies answer 413."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """Largest `max_tokens` a request may ask for (more answers 400)."""
    max_n: int = Field(default=16, ge=1)
    tenant_concurrency: int = Field(default=32, ge=1)
    """Requests one tenant may have in flight; more answer 429."""
    tenant_pinned_versions: int = Field(default=2, ge=1)
    """Versions other than its live one (`acme@v3`) one tenant may have requests in flight to at
    once; a request to yet another answers 429. Each such version holds an adapter slot."""
    tenant_rate_per_s: float = Field(default=50.0, gt=0)
    """Sustained requests per second per tenant (token bucket); more answer 429."""
    tenant_burst: int = Field(default=100, ge=1)
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

"""Settings of the Tinker-compatible training API (`CLORA_TRAINAPI_<FIELD>` overrides each field)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from clora.settings import settings_config


class TrainApiSettings(BaseSettings):
    model_config = settings_config("CLORA_TRAINAPI_")

    host: str = "127.0.0.1"
    """`CLORA_TRAINAPI_HOST`: the address the Tinker API binds (`0.0.0.0` in a container); its health
    check, `GET /api/v1/healthz`, answers on the same port."""
    port: int = Field(default=8600, ge=0, le=65535)
    """The Tinker door's own port (`TINKER_BASE_URL=http://<host>:<port>`)."""
    base_model: str = "smollm2"
    """The name clients pass as `base_model`; `get_info` answers it as `model_data.model_name`."""
    tokenizer_id: str | None = None
    """What the SDK loads with `AutoTokenizer.from_pretrained` on the client: a Hugging Face id or
    a path the client can read (None: `base_model`)."""
    max_context_length: int = Field(default=512, ge=8)
    """The longest datum `forward_backward` takes, in tokens (the learner's `max_seq_len`)."""
    retrieve_hold_s: float = Field(default=25.0, ge=0, le=40)
    """How long `retrieve_future` holds a pending request before answering 408 `try_again`; under
    the SDK's 45 s read timeout."""
    retrieve_poll_s: float = Field(default=1.0, gt=0, le=30)
    """A held `retrieve_future` is woken when its request finishes (a Redis pub/sub message);
    it also looks for the outcome this often, so a wake-up lost while the API's subscription
    reconnects delays an answer by at most this long."""
    future_ttl_s: float = Field(default=3600.0, gt=0)
    """How long a finished request's result is kept; after that its id answers 410."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """A request body as sent (compressed or not) at most; larger is 413."""
    max_decompressed_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """A zstd `forward_backward` body once decompressed at most; larger is 413."""
    compress_fwdbwd: bool = True
    """Ask the SDK to zstd-compress `forward_backward` bodies (`proto_compress_fwdbwd`)."""
    fwdbwd_max_chunk_len: int = Field(default=128, ge=1, le=1024)
    """Datums per `forward_backward` request the SDK sends at most."""
    fwdbwd_max_chunk_bytes: int = Field(default=4_000_000, ge=1024)
    """Estimated protobuf bytes per `forward_backward` request the SDK sends at most."""
    checkpoints_dir: Path = Path(".clora/trainapi/checkpoints")
    """Saved weights: `<checkpoints_dir>/<tenant>/<model_id>/{weights,sampler_weights}/<name>/`; a
    folder the API and the learners share, or with the S3 adapter store (`CLORA_STORAGE_BACKEND=s3`)
    each host's cache of the objects the store holds (`clora.trainapi.weights`)."""
    max_resident_runs: int = Field(default=4, ge=1)
    """A tenant's Tinker runs held in the learner's memory at most (each as large as a tenant's
    adapter state); a further run's request evicts the tenant's least recently used one, whose
    checkpoint keeps every applied step. Other tenants' runs and adapters are never evicted."""
    run_idle_s: float = Field(default=900.0, gt=0)
    """A run with no request for this long leaves the learner's memory (it reloads on its next)."""
    max_seq_ids_kept: int = Field(default=1024, ge=1)
    """Accepted `seq_id`s remembered per model, so a retried POST finds its request again."""
    gateway_url: str = "http://127.0.0.1:8000"
    """clora's gateway (`CLORA_GATEWAY_PORT`): `asample` runs there, on the shared engine, through its
    Tinker sampling route with the caller's own Tinker key (`clora.trainapi.sampling`)."""
    gateway_base_model: str = "base"
    """The name the gateway serves the base model under (`CLORA_ENGINE_BASE_NAME`): what a sampling
    session of `base_model` samples."""
    sample_timeout_s: float = Field(default=600.0, gt=0)
    """Longest one `asample` may take, waiting out the gateway's 429s and 503s included; past it the
    request fails (category `server`)."""
    max_samples_in_flight: int = Field(default=256, ge=1)
    """`asample` requests one tenant may have running in this service; more answer 429, which the
    SDK waits out and resends (the gateway's own per-tenant quota applies on top)."""
    max_num_samples: int = Field(default=1024, ge=1)
    """`num_samples` one `asample` may ask for at most; more answer 400 naming it, before one
    sequence id per sample is made (the gateway's own `max_n` applies on top)."""

    @model_validator(mode="after")
    def _chunks_fit(self) -> "TrainApiSettings":
        if self.fwdbwd_max_chunk_bytes > self.max_decompressed_bytes:
            raise ValueError("fwdbwd_max_chunk_bytes must not exceed max_decompressed_bytes")
        return self

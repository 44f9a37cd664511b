"""The control-plane JSON API (`/api/...`) and the tenant admin console (`/console/`).

    clora console                     # or as part of `clora up`, which prints the address

Every `/api` route needs `Authorization: Bearer <admin token>` (CLORA_ADMIN_TOKEN, or the
token `clora up` generates into `<data_dir>/admin_token`). Tenant API keys never open it.
The console is static HTML/JS/CSS shipped in the package (no CDN) that calls this API.

Routes: tenants (list, create — key shown once —, detail with the feedback its reward spec
left untrained and the guards' alerts, policy, pause/resume, delete), keys
(create, rotate, revoke), Tinker keys for the training API (create — shown once —, list,
revoke), adapter versions (lineage, promote, roll back, feedback -> served
freshness), buffers (depth,
recent examples), recent feedback, DLQ (view, replay one), metrics history.
"""

from __future__ import annotations

import hmac
from dataclasses import asdict
import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clora.checkpoint_storage import CheckpointStorage
from clora.freshness import percentile
from clora.registry import InvalidTenantField, LearningPolicy, Registry, RegistryError, TenantNotFound
from clora.web import MAX_JSON_DEPTH, BodyLimit, ErrorShape, HttpError, bearer_token, first_error, install_error_handlers
from clora.ingest.buffers import ReplayBuffer
from clora.ingest.reports import DLQ_RECENT_MAX, EVENTS_MAX, consumer_lag, recent_dead_letters, recent_service_events
from clora.ingest.schemas import EXAMPLE_KINDS, TOPIC_ADAPTERS, AdapterEvent
from clora.storage import AdapterStorage, StorageError
from clora.trainapi.purge import delete_tenant_runs
from clora.trainapi.settings import TrainApiSettings
from clora.trainapi.weights import CheckpointDir

STATIC = Path(__file__).parent / "static"
SHAPE: ErrorShape = "clora"
"""The control API's error shape: `{"error": {"code", "message", "field"}}` (`clora.web`)."""
MAX_BODY_BYTES = 1_048_576
"""The largest request body the control API reads (413 past it)."""


class NewTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="slug: a-z, 0-9, '_' or '-'")
    name: str = Field(default="", max_length=200)
    policy: LearningPolicy | None = None
    init_adapter: str | None = Field(default=None, description="a PEFT LoRA adapter folder on the platform's "
                                     "disk to start from; it becomes v1")
    signing_secret: bool = Field(default=False, description="require HMAC-signed feedback: a secret is "
                                 "generated and shown once")


class Rollback(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int | None = Field(default=None, ge=0, description="default: the live version's parent")


def load_admin_token(data_dir: Path, configured: str | None) -> str:
    """The configured token, else the one in `<data_dir>/admin_token` (created 0600 if absent)."""
    if configured:
        return configured
    path = data_dir / "admin_token"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    path.touch(mode=0o600)
    path.write_text(token)
    return token


def create_control_app(registry: Registry, buffers: ReplayBuffer, admin_token: str, publish=None,
                       ingest_group: str = "clora-ingest", storage: AdapterStorage | None = None,
                       checkpoints: CheckpointStorage | None = None, tinker_weights: CheckpointDir | None = None,
                       ) -> FastAPI:
    """`publish(topic, key, value_json)` sends adapter events and DLQ replays (None: disabled).
    `storage`, `checkpoints` and `tinker_weights`: where a deleted tenant's adapter versions,
    learner checkpoints (its own and its Tinker runs') and saved Tinker weights are removed
    from (None: that part of a deletion is left out)."""
    app = FastAPI(title="clora control plane", version="1")
    api = APIRouter(prefix="/api")

    install_error_handlers(app, SHAPE)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, shape=SHAPE, max_depth=MAX_JSON_DEPTH)

    def admin(request: Request) -> None:
        token = bearer_token(request.headers)
        if not token or not hmac.compare_digest(token.encode(), admin_token.encode()):
            raise HttpError(401, "admin_token_required", "send the admin token as 'Authorization: Bearer <token>'",
                            "Authorization")

    def tenant_or_404(tenant_id: str):
        try:
            return registry.get_tenant(tenant_id)
        except TenantNotFound as e:   # an id no tenant can have says so
            raise HttpError(404, "tenant_not_found", str(e), "tenant_id") from None

    def summary(t) -> dict[str, Any]:
        live = registry.live_version(t.id)
        versions = registry.adapter_versions(t.id)
        history = registry.metrics_history(t.id, 60)
        return {
            "id": t.id, "name": t.name, "paused": t.policy.paused, "algorithm": t.policy.algorithm,
            "live_version": live, "versions": len(versions),
            "active_keys": sum(k.revoked_at is None for k in registry.list_keys(t.id)),
            "rollbacks": sum(1 for v in versions if v.rolled_back is not None),   # by the reward guard
            "last_publish": max((v.created_at for v in versions), default=None),
            "buffer_depth": {k: buffers.depth(t.id, k) for k in EXAMPLE_KINDS},
            "heldout_depth": {k: buffers.depth(t.id, k, heldout=True) for k in EXAMPLE_KINDS},
            "reward_trend": [p.get("reward") for p in history if p.get("reward") is not None],
            "training_error": _training_error(history),
            # why a guard paused it (the reward-hacking guard), and why the gate last refused a
            # candidate on drift (the forgetting guard), unless one published since
            "paused_reason": t.policy.paused_reason,
            "drift_refusal": _drift_refusal(history),
        }

    def announce(tenant_id: str, action: str, version: int) -> None:
        if publish is None:
            return
        v = registry.adapter_version(tenant_id, version)
        ev = AdapterEvent(tenant=tenant_id, action=action, version=version, path=v.path, base_model=v.base_model,
                          parent_version=v.parent_version, metrics=v.eval_scores)
        publish(TOPIC_ADAPTERS, tenant_id, ev.model_dump_json())

    # --- tenants ------------------------------------------------------------------------

    @api.get("/tenants", dependencies=[Depends(admin)])
    def list_tenants():
        tenants = registry.list_tenants()
        last_hour = registry.traffic_totals([t.id for t in tenants])  # what the gateway served each
        return {"tenants": [{**summary(t), "last_hour": last_hour[t.id]} for t in tenants],
                "consumer_lag": consumer_lag(registry.r, ingest_group)}

    @api.post("/tenants", status_code=201, dependencies=[Depends(admin)])
    def create_tenant(body: NewTenant):
        secret = secrets.token_urlsafe(32) if body.signing_secret else None
        try:
            tenant, key = registry.create_tenant(body.id, name=body.name, policy=body.policy,
                                                 init_adapter=body.init_adapter, signing_secret=secret)
        except ValidationError as e:
            raise HttpError(422, "invalid_request", f"id: {e.errors()[0]['msg']}", "id") from e
        except InvalidTenantField as e:
            raise HttpError(422, "invalid_request", str(e), e.field) from e
        except RegistryError as e:
            raise HttpError(409, "tenant_exists", str(e), "id") from e
        return {"tenant": summary(tenant), "api_key": key, "signing_secret": secret,
                "init_adapter": tenant.init_adapter, "note": "the API key (and signing secret) is shown once"}

    @api.get("/tenants/{tenant_id}", dependencies=[Depends(admin)])
    def get_tenant(tenant_id: str):
        t = tenant_or_404(tenant_id)
        return {**summary(t), "policy": t.policy.model_dump(), "signed_feedback": bool(t.signing_secret),
                "keys": [k.model_dump() for k in registry.list_keys(t.id)],
                # scores stored but not trained on, by reason: the policy's reward_spec refused them
                "untrained_feedback": buffers.untrained_feedback(t.id),
                # what the guards did to it (the reward-hacking guard's pauses), newest first
                "alerts": [a.model_dump() for a in registry.alerts(t.id, 10)]}

    @api.patch("/tenants/{tenant_id}/policy", dependencies=[Depends(admin)])
    def update_policy(tenant_id: str, changes: dict[str, Any]):
        tenant_or_404(tenant_id)
        try:
            return registry.update_policy(tenant_id, **changes).model_dump()
        except ValidationError as e:
            field, message = first_error(e.errors(), default="body")
            raise HttpError(422, "invalid_policy", f"{field[:200]}: {message}", field[:200]) from e

    @api.post("/tenants/{tenant_id}/pause", dependencies=[Depends(admin)])
    def pause(tenant_id: str):
        tenant_or_404(tenant_id)
        return registry.update_policy(tenant_id, paused=True).model_dump()

    @api.post("/tenants/{tenant_id}/resume", dependencies=[Depends(admin)])
    def resume(tenant_id: str):
        tenant_or_404(tenant_id)
        return registry.update_policy(tenant_id, paused=False).model_dump()

    @api.delete("/tenants/{tenant_id}", dependencies=[Depends(admin)])
    def delete_tenant(tenant_id: str):
        """Delete a tenant and everything it owns, in an order a crash cannot spoil: retire it
        first (its keys stop authenticating, nothing is live, no learner or gateway lists it),
        then its replay buffers, Tinker runs and saved weights (`clora.trainapi.purge`),
        adapter folders or objects, learner checkpoints and registry data, and its record last.
        A DELETE that failed midway is retried to finish the job."""
        try:
            registry.retire_tenant(tenant_id)
        except TenantNotFound as e:
            raise HttpError(404, "tenant_not_found", str(e), "tenant_id") from None
        buffers.delete_tenant(tenant_id)
        try:
            delete_tenant_runs(registry.r, tenant_id, checkpoints, tinker_weights)   # its Tinker runs
            if storage is not None:
                storage.delete_tenant(tenant_id)
            if checkpoints is not None:
                checkpoints.delete(f"tenants/{tenant_id}")   # `clora.learner.checkpoint.tenant_checkpoint`
        except StorageError as e:
            raise HttpError(503, "storage_unavailable", f"tenant {tenant_id!r} is retired but its adapters are "
                            f"not all deleted yet ({e}); DELETE it again to finish") from e
        registry.purge_tenant(tenant_id)
        registry.drop_tenant(tenant_id)
        return {"deleted": tenant_id}

    # --- keys ---------------------------------------------------------------------------

    @api.post("/tenants/{tenant_id}/keys", status_code=201, dependencies=[Depends(admin)])
    def create_key(tenant_id: str):
        tenant_or_404(tenant_id)
        return {"api_key": registry.create_key(tenant_id), "note": "the API key is shown once"}

    @api.post("/tenants/{tenant_id}/keys/rotate", status_code=201, dependencies=[Depends(admin)])
    def rotate_keys(tenant_id: str, key_id: str | None = None):
        """A new key; revokes `key_id` (query parameter) or, without it, every active key."""
        tenant_or_404(tenant_id)
        if key_id is not None and key_id not in {k.key_id for k in registry.list_keys(tenant_id)}:
            raise HttpError(404, "key_not_found", f"tenant {tenant_id!r} has no key {key_id[:100]!r}", "key_id")
        return {"api_key": registry.rotate_key(tenant_id, key_id),
                "note": "the API key is shown once; old keys revoked"}

    @api.delete("/tenants/{tenant_id}/keys/{key_id}", dependencies=[Depends(admin)])
    def revoke_key(tenant_id: str, key_id: str):
        tenant_or_404(tenant_id)
        try:
            registry.revoke_key(tenant_id, key_id)
        except RegistryError as e:
            raise HttpError(404, "key_not_found", str(e), "key_id") from e
        return {"revoked": key_id}

    # --- Tinker keys (the training API's, `clora.trainapi`) ------------------------------

    @api.post("/tenants/{tenant_id}/tinker-keys", status_code=201, dependencies=[Depends(admin)])
    def create_tinker_key(tenant_id: str):
        tenant_or_404(tenant_id)
        key = registry.create_tinker_key(tenant_id)
        return {"tinker_key": key, "key_id": registry.authenticate_tinker(key).key_id,
                "note": "the Tinker key is shown once"}

    @api.get("/tenants/{tenant_id}/tinker-keys", dependencies=[Depends(admin)])
    def list_tinker_keys(tenant_id: str):
        tenant_or_404(tenant_id)
        return {"tinker_keys": [k.model_dump() for k in registry.list_tinker_keys(tenant_id)]}

    @api.delete("/tenants/{tenant_id}/tinker-keys/{key_id}", dependencies=[Depends(admin)])
    def revoke_tinker_key(tenant_id: str, key_id: str):
        tenant_or_404(tenant_id)
        try:
            registry.revoke_tinker_key(tenant_id, key_id)
        except RegistryError as e:
            raise HttpError(404, "key_not_found", str(e), "key_id") from e
        return {"revoked": key_id}

    # --- adapter versions ---------------------------------------------------------------

    @api.get("/tenants/{tenant_id}/versions", dependencies=[Depends(admin)])
    def versions(tenant_id: str):
        tenant_or_404(tenant_id)
        rewards = buffers.version_rewards(tenant_id)

        def served(version: int | None) -> dict | None:
            t = rewards.get(version)
            return None if t is None else {"samples": t.n, "mean": t.mean}

        fresh = registry.freshness(tenant_id)
        return {"live": registry.live_version(tenant_id), "base_reward": served(None),
                "versions": [v.model_dump(exclude={"canary"}) | {"served_reward": served(v.version),
                                               "freshness": _dump(fresh.get(v.version))}
                             for v in registry.adapter_versions(tenant_id)]}

    @api.get("/tenants/{tenant_id}/freshness", dependencies=[Depends(admin)])
    def freshness(tenant_id: str):
        """Feedback -> served: each served version's summary (`clora.freshness.FreshnessSummary`)
        and, over every event of every served version, the tenant's p50 and p99 seconds from a
        feedback event's 202 to the first completion of the version first trained on it."""
        tenant_or_404(tenant_id)
        seconds = [s for per_version in registry.event_freshness(tenant_id).values() for s in per_version]
        return {"events": len(seconds), "p50_s": percentile(seconds, 50) if seconds else None,
                "p99_s": percentile(seconds, 99) if seconds else None,
                "versions": [{"version": v, **s.model_dump()} for v, s in registry.freshness(tenant_id).items()]}

    def make_live(tenant_id: str, version: int, action: str) -> dict:
        """Set the live version (404 naming `version` when it is not recorded) and announce it."""
        try:
            registry.set_live_version(tenant_id, version)
        except RegistryError as e:
            raise HttpError(404, "version_not_found", str(e), "version") from e
        announce(tenant_id, action, version)
        return {"live": version}

    @api.post("/tenants/{tenant_id}/versions/{version}/promote", dependencies=[Depends(admin)])
    def promote(tenant_id: str, version: int):
        tenant_or_404(tenant_id)
        return make_live(tenant_id, version, "promoted")

    @api.post("/tenants/{tenant_id}/rollback", dependencies=[Depends(admin)])
    def rollback(tenant_id: str, body: Rollback):
        tenant_or_404(tenant_id)
        target = body.version
        if target is None:
            live = registry.live_version(tenant_id)
            parent = registry.adapter_version(tenant_id, live).parent_version if live is not None else None
            if parent is None:
                raise HttpError(409, "nothing_to_roll_back", "the live version has no parent", "version")
            target = parent
        return make_live(tenant_id, target, "rolled_back")

    # --- data -----------------------------------------------------------------------------

    @api.get("/tenants/{tenant_id}/buffers", dependencies=[Depends(admin)])
    def tenant_buffers(tenant_id: str, n: int = 10):
        tenant_or_404(tenant_id)
        n = max(1, min(n, 100))
        return {"depth": {k: buffers.depth(tenant_id, k) for k in EXAMPLE_KINDS},
                "stats": buffers.stats(tenant_id),
                "recent": {k: [e.model_dump() for e in buffers.latest(tenant_id, k, n)] for k in EXAMPLE_KINDS}}

    @api.get("/tenants/{tenant_id}/feedback", dependencies=[Depends(admin)])
    def tenant_feedback(tenant_id: str, n: int = 50):
        """Recent feedback, each with the interaction it is about (when it is still stored)."""
        tenant_or_404(tenant_id)
        feedback = buffers.recent_feedback(tenant_id, max(1, min(n, 200)))
        interactions = buffers.interactions(tenant_id, [f["interaction_id"] for f in feedback])
        for f, ix in zip(feedback, interactions):
            f["interaction"] = None if ix is None else {
                "prompt": ix.messages[-1].content, "response": ix.response.content,
                "tool_calls": [c.function.model_dump() for c in ix.response.tool_calls or []],
                "adapter": ix.adapter, "adapter_version": ix.adapter_version, "time": ix.time}
        return {"feedback": feedback}

    @api.get("/tenants/{tenant_id}/metrics", dependencies=[Depends(admin)])
    def tenant_metrics(tenant_id: str, n: int = 500):
        tenant_or_404(tenant_id)
        return {"points": registry.metrics_history(tenant_id, max(1, min(n, 2000)))}

    @api.get("/tenants/{tenant_id}/traffic", dependencies=[Depends(admin)])
    def tenant_traffic(tenant_id: str, minutes: int = 60):
        """What the gateway served the tenant in each of the last `minutes` minutes, oldest first
        (`clora.serving.traffic` names the counters)."""
        tenant_or_404(tenant_id)
        return {"minutes": registry.traffic(tenant_id, max(1, min(minutes, 24 * 60)))}

    @api.get("/dlq", dependencies=[Depends(admin)])
    def dlq(n: int = 100):
        letters = recent_dead_letters(registry.r, max(1, min(n, DLQ_RECENT_MAX)))
        return {"dead_letters": [letter.model_dump(mode="json") for letter in letters]}

    @api.get("/platform/events", dependencies=[Depends(admin)])
    def platform_events(n: int = 50):
        """What the supervisor did about the platform's services, newest first: a service that
        exited or stopped answering and was restarted, a restart that failed, an ingest group
        that stalled, and the embedded broker restarting empty (`data_lost`)."""
        events = recent_service_events(registry.r, max(1, min(n, EVENTS_MAX)))
        return {"events": [asdict(e) for e in events]}

    @api.get("/engine", dependencies=[Depends(admin)])
    def engine():
        """Each gateway's engine replicas as it last reported them (`EngineManager.report`): health,
        resident adapters, and the adapters a replica is out of rotation for (its load or canary
        failed) with the reason and when it is retried."""
        return {"gateways": [{"gateway": g, **r} for g, r in sorted(registry.engine_reports().items())]}

    @api.post("/dlq/{event_id}/replay", dependencies=[Depends(admin)])
    def dlq_replay(event_id: str):
        for letter in recent_dead_letters(registry.r):
            if letter.event_id == event_id:
                if publish is None:
                    raise HttpError(503, "broker_unavailable", "this console has no broker connection")
                publish(letter.source_topic, letter.key or "", letter.payload)
                return {"replayed": event_id, "topic": letter.source_topic}
        raise HttpError(404, "dead_letter_not_found", f"no dead letter {event_id!r}", "event_id")

    app.include_router(api)

    # --- the console (static) -------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    def root():
        return RedirectResponse("/console/")

    @app.get("/console/", include_in_schema=False)
    def console_page():
        return FileResponse(STATIC / "console.html", headers={
            "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:",
            "X-Content-Type-Options": "nosniff"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def build(kafka_bootstrap: str, redis_url: str, admin_token: str, ingest_group: str = "clora-ingest") -> FastAPI:
    import redis

    from clora.ingest.producer import EventProducer

    from clora.serving.settings import EngineSettings

    from clora.checkpoint_storage import open_checkpoint_storage
    from clora.learner.settings import LearnerSettings
    from clora.storage import StorageSettings, open_storage

    client = redis.Redis.from_url(redis_url)
    producer = EventProducer(kafka_bootstrap, timeout_s=5.0)
    registry = Registry(client, reserved_ids=[EngineSettings().base_name])   # no tenant shadows the base model
    learner, stored = LearnerSettings(), StorageSettings()   # where the learner keeps what a deletion removes
    return create_control_app(registry, ReplayBuffer(client), admin_token, publish=producer.send_sync,
                              ingest_group=ingest_group, storage=open_storage(stored, learner.adapters_dir),
                              checkpoints=open_checkpoint_storage(stored, learner.checkpoints_dir),
                              tinker_weights=CheckpointDir(TrainApiSettings().checkpoints_dir, stored))


def _dump(model: BaseModel | None) -> dict | None:
    return None if model is None else model.model_dump()


def _drift_refusal(history: list[dict]) -> dict | None:
    """The forgetting guard's last refusal of a candidate, unless a version was published since."""
    for point in reversed(history):
        if "refused" in point:
            return {"reason": point["refused"], "drift": point.get("drift"), "time": point.get("time"),
                    "step": point.get("step")}
        if point.get("version") is not None:
            return None
    return None


def _training_error(history: list[dict]) -> dict | None:
    """The learner's last failure on this tenant, unless a step or a publish succeeded since."""
    for point in reversed(history):
        if "failed" in point:
            return {"error": point["failed"], "time": point.get("time"), "failures": point.get("failures"),
                    "retry_in_s": point.get("retry_in_s")}
        if point.get("loss") is not None or point.get("version") is not None:
            return None
    return None

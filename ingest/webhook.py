"""The feedback webhook: `POST /v1/feedback` (one record) and `POST /v1/feedback/batch`.

    clora webhook                     # or as part of `clora up`

Answers:
- 202 only after the broker acknowledged the write (acks=all) — the event is stored;
- 503 (with Retry-After) when the broker did not acknowledge in time — nothing promised;
- 422 naming the invalid field; 413 past the body or batch limit;
- 401 for a missing, unknown or revoked API key or a bad/stale HMAC signature;
- 403 for feedback on an interaction that was served to another tenant.
A client may retry any request with the same `event_id`s: ingest stores each once.

Signing (optional, per tenant): when a tenant has a signing secret, requests must carry
`X-Clora-Timestamp: <unix seconds>` and `X-Clora-Signature: sha256=<hex HMAC-SHA256 of
"{timestamp}." + body>`, within the replay window.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError

from clora.registry import Registry, Tenant, TenantNotFound, fetch_interaction_owners, sign
from clora.web import BodyLimit, ErrorShape, HttpError, api_key, install_error_handlers
from clora.ingest.settings import WebhookSettings
from clora.ingest import metrics
from clora.ingest.producer import BrokerUnavailable, EventProducer
from clora.ingest.schemas import TOPIC_FEEDBACK, FeedbackBatchIn, FeedbackEvent, FeedbackIn

log = logging.getLogger(__name__)


class Accepted(BaseModel):
    accepted: int
    event_ids: list[str]


class ErrorBody(BaseModel):
    error: dict


SHAPE: ErrorShape = "clora"
"""The webhook's error shape: `{"error": {"code", "message", "field"}}` (`clora.web`)."""


def _count_error(status: int) -> None:
    metrics.WEBHOOK.labels(str(status)).inc()


@dataclass
class _Cached:
    tenant: Tenant | None
    expires: float


class Authenticator:
    """API key -> tenant, with a short in-process cache (revocation applies within `ttl_s`)."""

    def __init__(self, registry: Registry, ttl_s: float):
        self.registry, self.ttl_s = registry, ttl_s
        self._cache: dict[str, _Cached] = {}

    def tenant_for(self, key: str) -> Tenant | None:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit.expires > now:
            return hit.tenant
        principal = self.registry.authenticate(key)
        tenant = None
        if principal is not None:
            try:
                tenant = self.registry.get_tenant(principal.tenant)
            except TenantNotFound:
                tenant = None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key] = _Cached(tenant, now + self.ttl_s)
        return tenant


class OwnerLookup:
    """Interaction id -> the tenant it was served to, on an asyncio Redis client. Lookups
    that arrive while one MGET is in flight share the next one, so N concurrent requests cost
    about two round trips instead of N."""

    def __init__(self, client):
        self.client = client
        self._waiting: list[tuple[list[str], asyncio.Future]] = []
        self._running = False
        self._task: asyncio.Task | None = None

    async def owners(self, interaction_ids: list[str]) -> list[str | None]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((interaction_ids, future))
        if not self._running:
            self._running = True
            self._task = asyncio.get_running_loop().create_task(self._drain())   # a reference keeps it alive
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    found = await fetch_interaction_owners(self.client, [i for ids, _ in batch for i in ids])
                except Exception as e:  # every waiter gets the error: none is answered 202
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                at = 0
                for ids, future in batch:
                    owners, at = found[at:at + len(ids)], at + len(ids)
                    if not future.done():
                        future.set_result(owners)
        finally:
            self._running = False


def create_app(settings: WebhookSettings, registry: Registry, producer: EventProducer,
               async_redis=None) -> FastAPI:
    """The webhook app. `async_redis` (a `redis.asyncio` client on the registry's Redis) keeps
    the per-request interaction-owner lookup off the event loop's critical path; without it
    the registry's blocking client is used."""

    lookup = OwnerLookup(async_redis) if async_redis is not None else None

    async def owners_of(interaction_ids: list[str]) -> list[str | None]:
        if lookup is None:
            return registry.interaction_owners(interaction_ids)
        return await lookup.owners(interaction_ids)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        producer.close()

    app = FastAPI(title="clora feedback webhook", version="1", lifespan=lifespan,
                  description="Feedback on served interactions: rewards, corrections, comments.")
    auth = Authenticator(registry, settings.auth_cache_s)
    responses = {s: {"model": ErrorBody} for s in (401, 403, 413, 422, 503)}

    install_error_handlers(app, SHAPE, on_error=_count_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, shape=SHAPE, on_error=_count_error)

    async def tenant_of(request: Request) -> Tenant:
        key = api_key(request.headers)
        if not key:
            raise HttpError(401, "missing_api_key", "send the tenant API key as 'Authorization: Bearer <key>'")
        try:
            tenant = auth.tenant_for(key)
        except RedisError as e:
            raise _registry_unavailable(e) from e
        if tenant is None:
            raise HttpError(401, "invalid_api_key", "unknown or revoked API key")
        if tenant.signing_secret:
            await _check_signature(request, tenant.signing_secret, settings.hmac_window_s)
        return tenant

    async def _publish(tenant: Tenant, records: list[FeedbackIn]) -> JSONResponse:
        try:
            owners = await owners_of([rec.interaction_id for rec in records])
        except RedisError as e:
            raise _registry_unavailable(e) from e
        for i, owner in enumerate(owners):
            if owner is not None and owner != tenant.id:
                field = "interaction_id" if len(records) == 1 else f"records.{i}.interaction_id"
                raise HttpError(403, "forbidden", "this interaction was not served to your tenant", field)
        events = [FeedbackEvent.accept(tenant.id, rec) for rec in records]
        try:
            await producer.send_many_and_wait(TOPIC_FEEDBACK, [(e.tenant, e.model_dump_json()) for e in events])
        except BrokerUnavailable as e:
            log.warning("feedback for %s not stored: %s", tenant.id, e)
            raise HttpError(503, "broker_unavailable", "the event log is unavailable; nothing was stored, retry",
                            headers={"Retry-After": "1"}) from e
        metrics.WEBHOOK.labels("202").inc()
        metrics.WEBHOOK_EVENTS.inc(len(events))
        return JSONResponse(Accepted(accepted=len(events), event_ids=[e.event_id for e in events]).model_dump(),
                            status_code=202)

    @app.post("/v1/feedback", status_code=202, response_model=Accepted, responses=responses,
              summary="Send one feedback record")
    async def feedback(record: FeedbackIn, tenant: Tenant = Depends(tenant_of)):
        return await _publish(tenant, [record])

    @app.post("/v1/feedback/batch", status_code=202, response_model=Accepted, responses=responses,
              summary="Send up to `max_batch` feedback records in one request")
    async def feedback_batch(batch: FeedbackBatchIn, tenant: Tenant = Depends(tenant_of)):
        if len(batch.records) > settings.max_batch:
            raise HttpError(413, "batch_too_large", f"{len(batch.records)} records exceed the limit of "
                            f"{settings.max_batch}", "records")
        return await _publish(tenant, batch.records)

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return {"ok": True}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _check_signature(request: Request, secret: str, window_s: int) -> None:
    ts = request.headers.get("x-clora-timestamp", "")
    sig = request.headers.get("x-clora-signature", "")
    if not ts or not sig:
        raise HttpError(401, "signature_required", "this tenant requires X-Clora-Timestamp and X-Clora-Signature")
    try:
        age = abs(time.time() - float(ts))
    except ValueError:
        raise HttpError(401, "bad_signature", "X-Clora-Timestamp must be unix seconds", "X-Clora-Timestamp") from None
    if age > window_s:
        raise HttpError(401, "stale_signature", f"timestamp is {age:.0f} s from now (window {window_s} s)")
    expected = "sha256=" + sign(secret, ts, await request.body())
    if not hmac.compare_digest(expected, sig):
        raise HttpError(401, "bad_signature", "X-Clora-Signature does not match the body")


def build(settings: WebhookSettings, kafka_bootstrap: str, redis_url: str) -> FastAPI:
    """The app wired to real connections (used by `clora webhook` and uvicorn's factory)."""
    import redis

    registry = Registry(redis.Redis.from_url(redis_url))
    producer = EventProducer(kafka_bootstrap, timeout_s=settings.ack_timeout_s)
    return create_app(settings, registry, producer, async_redis=async_redis_client(redis_url))


def _registry_unavailable(e: Exception) -> HttpError:
    log.warning("registry (Redis) unavailable: %s", e)
    return HttpError(503, "registry_unavailable", "the registry is unavailable; nothing was stored, retry",
                     headers={"Retry-After": "1"})


def async_redis_client(redis_url: str):
    """An asyncio Redis client that reconnects and retries (a Redis restart costs a retry,
    not a failed request)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return redis.asyncio.Redis.from_url(redis_url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 5),
                                        retry_on_error=[RedisConnectionError, RedisTimeoutError])


def app_from_env() -> FastAPI:
    """uvicorn factory: `uvicorn --factory clora.ingest.webhook:app_from_env`."""
    from clora.settings import PlatformSettings

    platform = PlatformSettings()
    if not platform.kafka_bootstrap or not platform.redis_url:
        raise RuntimeError("CLORA_KAFKA_BOOTSTRAP and CLORA_REDIS_URL must be set for the webhook")
    return build(WebhookSettings(), platform.kafka_bootstrap, platform.redis_url)

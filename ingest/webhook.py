"""The feedback webhook: `POST /v1/feedback` (one record) and `POST /v1/feedback/batch`.

    clora webhook                     # or as part of `clora up`

Answers:
- 202 only after the broker acknowledged the write (acks=all) — the event is stored;
- 503 (with Retry-After) when the broker did not acknowledge in time — nothing promised;
- 422 naming the invalid field (a non-finite number, a body or tool-call `arguments` nested
  deeper than `clora.web.MAX_JSON_DEPTH`, the bare id of a response with n > 1 choices, whose
  feedback names one choice, `{id}-{index}`); 413 past the body or batch limit;
- 401 for a missing, unknown or revoked API key or a bad/stale HMAC signature;
- 403 for feedback on an interaction that was served to another tenant;
- 404 `interaction_not_found` naming the field (`interaction_id`, `records.N.interaction_id`)
  for an id of the gateway's shape (`clora.ids.is_gateway_interaction_id`: `chatcmpl-{32 hex}`,
  its choices `{id}-{i}`) that the gateway never served (or served longer ago than its claim
  lasts, 7 days) — it can never join;
- 429 (with Retry-After) past the tenant's quota of records/s or bytes/s (`WebhookSettings.quota_*`,
  counted in Redis under `clora:quota:` so that every webhook instance shares it).
A client may retry any request with the same `event_id`s: ingest stores each once.

Pending feedback: an id of any other shape names an interaction the client records itself (on
`clora.interactions`), which may arrive after its feedback. Such a record is accepted (202),
counted in `clora_webhook_feedback_pending_total`, and parked by ingest until its interaction
arrives; if none does within `IngestSettings.interaction_ttl_s`, it expires unjoined.

Signing (optional, per tenant): when a tenant has a signing secret, requests must carry
`X-Clora-Timestamp: <unix seconds>` and `X-Clora-Signature: sha256=<hex HMAC-SHA256 of
"{timestamp}." + body>`, within the replay window. A signed record without an `event_id` is
named by the signature and its index (`clora.ids.derived_id`), so a replayed request stores
nothing new either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError

from clora.ids import derived_id, is_gateway_interaction_id
from clora.procs import tune_gc
from clora.settings import ASYNC_REDIS_CONNECTIONS
from clora.registry import Registry, Tenant, TenantNotFound, fetch_interaction_owners, fetch_multi_choice, sign
from clora.web import MAX_JSON_DEPTH, BodyLimit, ErrorShape, HttpError, api_key, install_error_handlers
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


class Coalesced:
    """Per-item calls (`run(key, items) -> one answer per item`) where the calls of one key that
    arrive while one is in flight share the next one: N concurrent requests cost about two
    calls instead of N. If the shared call raises, every caller sharing it gets the error."""

    def __init__(self, run: Callable[[Hashable, list], Awaitable[list]]):
        self.run = run
        self._waiting: dict[Hashable, list[tuple[list, asyncio.Future]]] = {}
        self._drains: dict[Hashable, asyncio.Task] = {}
        """Per key, the task making its waiting calls (a reference keeps it alive)."""

    async def __call__(self, items: list, key: Hashable = None) -> list:
        if not items:
            return []
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((items, future))
        if key not in self._drains:
            self._drains[key] = asyncio.get_running_loop().create_task(self._drain(key))
        return await future

    async def _drain(self, key: Hashable) -> None:
        try:
            while self._waiting.get(key):
                batch = self._waiting.pop(key)
                try:
                    found = await self.run(key, [i for items, _ in batch for i in items])
                except Exception as e:  # noqa: BLE001 - every waiter gets the error: none is answered 202
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                at = 0
                for items, future in batch:
                    answers, at = found[at:at + len(items)], at + len(items)
                    if not future.done():
                        future.set_result(answers)
        finally:
            del self._drains[key]


def coalesced_lookup(client, fetch: Callable[[Any, list], Awaitable[list]]) -> Coalesced:
    """`fetch(client, ids)` on an asyncio Redis client, `Coalesced`: the interactions' owners and
    the bare ids of n > 1 responses (`clora.registry`)."""
    return Coalesced(lambda _key, ids: fetch(client, ids))


QUOTA_PREFIX = "clora:quota"
"""Where `limits` keeps the tenants' quota counters in Redis."""


class TenantQuota:
    """Each tenant's feedback records/s and request-body bytes/s, averaged over a sliding window
    (`WebhookSettings.quota_*`), counted in Redis by `limits`' sliding-window counter: every
    webhook instance charges the same count, and each tenant has its own.

    A tenant's requests that arrive while its charge is in flight are charged together next:
    one hit of their summed records and one of their summed bytes, which is what charging them
    one after another comes to when all fit. When the sum does not fit, each is charged on its
    own, so each gets the verdict it would have had alone. Under single-record load the two
    round trips per request were ~28% of the webhook's CPU."""

    def __init__(self, client, settings: WebhookSettings):
        from limits import RateLimitItemPerSecond
        from limits.aio.storage import RedisStorage
        from limits.aio.strategies import SlidingWindowCounterRateLimiter

        window = settings.quota_window_s
        self.records = RateLimitItemPerSecond(settings.quota_events_per_s * window, window, namespace="records")
        self.bytes = RateLimitItemPerSecond(settings.quota_bytes_per_s * window, window, namespace="bytes")
        storage = RedisStorage("async+redis://", implementation="redispy", key_prefix=QUOTA_PREFIX,
                               connection_pool=client.connection_pool)
        self.limiter = SlidingWindowCounterRateLimiter(storage)
        self._charges = Coalesced(self._charge_all)

    async def charge(self, tenant: str, records: int, nbytes: int) -> None:
        """Count one request against the tenant's quotas, or raise the 429 saying when to retry
        (or the Redis error that kept it from being counted)."""
        verdict, = await self._charges([(records, nbytes)], key=tenant)
        if verdict is not None:
            raise verdict

    async def _charge_all(self, tenant: str, costs: list[tuple[int, int]]) -> list[HttpError | None]:
        """Each request's verdict (None: counted), records first, then bytes, as one at a time
        would give them."""
        verdicts: list[HttpError | None] = [None] * len(costs)
        for item, at in ((self.records, 0), (self.bytes, 1)):
            live = [i for i, v in enumerate(verdicts) if v is None]
            if len(live) > 1 and await self.limiter.hit(item, tenant, cost=sum(costs[i][at] for i in live)):
                continue
            for i in live:
                if not await self.limiter.hit(item, tenant, cost=costs[i][at]):
                    verdicts[i] = await self._refusal(item, tenant)
        return verdicts

    async def _refusal(self, item, tenant: str) -> HttpError:
        stats = await self.limiter.get_window_stats(item, tenant)
        retry = max(1, math.ceil(stats.reset_time - time.time()))
        return HttpError(429, "quota_exceeded", f"tenant {tenant!r} is over its quota of {item.amount} "
                         f"{item.namespace} per {item.multiples} s; retry in {retry} s",
                         headers={"Retry-After": str(retry)})


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant, and the request's signature when the tenant signs."""

    tenant: Tenant
    signature: str | None


def create_app(settings: WebhookSettings, registry: Registry, producer: EventProducer, async_redis) -> FastAPI:
    """The webhook app. `async_redis` (a `redis.asyncio` client on the registry's Redis) serves
    the per-request lookups (interaction owners, quotas) without blocking the event loop."""

    owners_of = coalesced_lookup(async_redis, fetch_interaction_owners)
    multi_choice_of = coalesced_lookup(async_redis, fetch_multi_choice)
    quota = TenantQuota(async_redis, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        producer.close()

    app = FastAPI(title="clora feedback webhook", version="1", lifespan=lifespan,
                  description="Feedback on served interactions: rewards, corrections, comments.")
    auth = Authenticator(registry, settings.auth_cache_s)
    responses = {s: {"model": ErrorBody} for s in (401, 403, 404, 413, 422, 429, 503)}

    install_error_handlers(app, SHAPE, on_error=_count_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, shape=SHAPE, on_error=_count_error,
                       max_depth=MAX_JSON_DEPTH)

    async def caller_of(request: Request) -> Caller:
        key = api_key(request.headers)
        if not key:
            raise HttpError(401, "missing_api_key", "send the tenant API key as 'Authorization: Bearer <key>'")
        try:
            tenant = auth.tenant_for(key)
        except RedisError as e:
            raise _registry_unavailable(e) from e
        if tenant is None:
            raise HttpError(401, "invalid_api_key", "unknown or revoked API key")
        signature = None
        if tenant.signing_secret:
            signature = await _check_signature(request, tenant.signing_secret, settings.hmac_window_s)
        return Caller(tenant, signature)

    async def _publish(caller: Caller, records: list[FeedbackIn], request: Request, batch: bool) -> JSONResponse:
        tenant = caller.tenant

        def field(i: int) -> str:
            return f"records.{i}.interaction_id" if batch else "interaction_id"

        try:
            owners = await owners_of([rec.interaction_id for rec in records])
            unowned = [i for i, owner in enumerate(owners) if owner is None]
            # only the gateway serves n > 1 responses, under ids it mints: no other id is one
            minted = [i for i in unowned if is_gateway_interaction_id(records[i].interaction_id)]
            found = dict(zip(minted, await multi_choice_of([records[i].interaction_id for i in minted])))
            multi = [found.get(i) for i in unowned]
        except RedisError as e:
            raise _registry_unavailable(e) from e
        for i, owner in enumerate(owners):
            if owner is not None and owner != tenant.id:
                raise HttpError(403, "forbidden", "this interaction was not served to your tenant", field(i))
        for i, response in zip(unowned, multi):
            if response is None:
                continue
            if response.tenant != tenant.id:
                raise HttpError(403, "forbidden", "this interaction was not served to your tenant", field(i))
            raise HttpError(422, "choice_required", f"{field(i)}: {response.response_id} is the id of a response with "
                            f"several choices, and feedback is about one of them: send it on "
                            f"{response.describe_ids()} (`{{id}}-{{index}}` of the choice)", field(i))
        pending = [i for i, response in zip(unowned, multi) if response is None]
        for i in pending:
            if is_gateway_interaction_id(records[i].interaction_id):
                raise HttpError(404, "interaction_not_found", f"{field(i)}: the gateway never served "
                                f"{records[i].interaction_id!r} (or served it longer ago than the platform keeps "
                                f"interactions): feedback on it could never join one", field(i))
        try:
            await quota.charge(tenant.id, len(records), len(await request.body()))
        except RedisError as e:
            raise _registry_unavailable(e) from e
        events = [FeedbackEvent.accept(tenant.id, rec, None if caller.signature is None
                                       else derived_id("fb", caller.signature, str(i)))
                  for i, rec in enumerate(records)]
        try:
            await producer.send_many_and_wait(TOPIC_FEEDBACK, [(e.tenant, e.model_dump_json()) for e in events])
        except BrokerUnavailable as e:
            log.warning("feedback for %s not stored: %s", tenant.id, e)
            raise HttpError(503, "broker_unavailable", "the event log is unavailable; nothing was stored, retry",
                            headers={"Retry-After": "1"}) from e
        metrics.WEBHOOK.labels("202").inc()
        metrics.WEBHOOK_EVENTS.inc(len(events))
        metrics.FEEDBACK_PENDING.inc(len(pending))
        return JSONResponse(Accepted(accepted=len(events), event_ids=[e.event_id for e in events]).model_dump(),
                            status_code=202)

    @app.post("/v1/feedback", status_code=202, response_model=Accepted, responses=responses,
              summary="Send one feedback record")
    async def feedback(record: FeedbackIn, request: Request, caller: Caller = Depends(caller_of)):
        return await _publish(caller, [record], request, batch=False)

    @app.post("/v1/feedback/batch", status_code=202, response_model=Accepted, responses=responses,
              summary="Send up to `max_batch` feedback records in one request")
    async def feedback_batch(batch: FeedbackBatchIn, request: Request, caller: Caller = Depends(caller_of)):
        if len(batch.records) > settings.max_batch:
            raise HttpError(413, "batch_too_large", f"{len(batch.records)} records exceed the limit of "
                            f"{settings.max_batch}", "records")
        return await _publish(caller, batch.records, request, batch=True)

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return {"ok": True}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


_TIMESTAMP = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")
"""Unix seconds, optionally with a fraction: finite, and ASCII digits only (`float` would also
take "nan", "inf", "1e9" and other scripts' digits)."""
_SIGNATURE = re.compile(r"sha256=[0-9a-f]{64}")


async def _check_signature(request: Request, secret: str, window_s: int) -> str:
    """The request's signature when it is well-formed, fresh and matches the body, else the 401
    saying which header is wrong."""
    ts = request.headers.get("x-clora-timestamp", "")
    sig = request.headers.get("x-clora-signature", "")
    if not ts or not sig:
        raise HttpError(401, "signature_required", "this tenant requires X-Clora-Timestamp and X-Clora-Signature")
    if not _TIMESTAMP.fullmatch(ts):
        raise HttpError(401, "bad_signature", "X-Clora-Timestamp must be unix seconds (digits, optionally a "
                        "fraction)", "X-Clora-Timestamp")
    age = abs(time.time() - float(ts))
    if age > window_s:
        raise HttpError(401, "stale_signature", f"timestamp is {age:.0f} s from now (window {window_s} s)",
                        "X-Clora-Timestamp")
    sig = sig.lower()
    if not _SIGNATURE.fullmatch(sig):
        raise HttpError(401, "bad_signature", "X-Clora-Signature must be sha256=<64 hex digits>", "X-Clora-Signature")
    expected = "sha256=" + sign(secret, ts, await request.body())
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        raise HttpError(401, "bad_signature", "X-Clora-Signature does not match the body", "X-Clora-Signature")
    return sig


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


REDIS_CONNECTIONS = ASYNC_REDIS_CONNECTIONS
"""An asyncio client's most connections to Redis; a request that finds them all busy waits for
one (`REDIS_CONNECTION_WAIT_S`)."""
REDIS_CONNECTION_WAIT_S = 10.0


def async_redis_client(redis_url: str):
    """An asyncio Redis client that reconnects and retries (a Redis restart costs a retry,
    not a failed request). Its pool blocks: redis-py's default pool refuses the 101st
    concurrent command with "Too many connections", which answered a burst of requests 503."""
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=REDIS_CONNECTIONS, timeout=REDIS_CONNECTION_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 5), retry_on_error=[RedisConnectionError, RedisTimeoutError])
    return redis.asyncio.Redis(connection_pool=pool)


def app_from_env() -> FastAPI:
    """uvicorn factory: `uvicorn --factory clora.ingest.webhook:app_from_env`."""
    from clora.settings import PlatformSettings

    platform = PlatformSettings()
    if not platform.kafka_bootstrap or not platform.redis_url:
        raise RuntimeError("CLORA_KAFKA_BOOTSTRAP and CLORA_REDIS_URL must be set for the webhook")
    app = build(WebhookSettings(), platform.kafka_bootstrap, platform.redis_url)
    tune_gc()
    return app

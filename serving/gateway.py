"""The OpenAI-compatible gateway (FastAPI): authentication, tenant -> adapter routing,
quotas, streaming pass-through, interaction logging.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` (OpenAI's
Responses API, served as a chat completion: `clora.serving.responses`), `GET /v1/models`,
`GET /v1/models/{model}`, `GET /health`, and `POST /v1/tinker/sample`, the Tinker training
API's token-level sampling (`clora.serving.tinker_sampling`; Tinker keys only). Every error,
an unknown route's 404 and a wrong method's 405 included, answers in OpenAI's error shape.

`model` is the base model name, the caller's tenant id (its live adapter version; the base
model until its first version is live), a pinned version `tenant@v7`
(`clora.ids.served_name`), or the `tinker://<model id>/sampler_weights/<name>` path a Tinker
run of the caller's tenant saved (`Registry.tinker_sampler_version`: the version it was
published as, never live by itself, loaded on demand like any pinned one). Any other tenant's
model or path answers 404 `model_not_found`, exactly like a model that does not exist. The
response `id` is the interaction id: it is claimed in the registry for the caller's tenant
before the response is sent, and feedback names it.
The first completion answered with each adapter version starts its freshness measurement
(`clora.serving.freshness`), off the request path.

A request holds, in this order: its tenant's quota slot (`clora.serving.quota`: 429 past a
per-tenant limit), its place among the engine sequences in flight (`clora.serving.fair_queue`,
with `fair_admission`: it may wait there, in weighted fair order across tenants), then its engine
lease. A request waiting in the fair queue therefore already counts against its tenant's quota and
pinned-version limit, and one cancelled there gives back both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clora.registry import ApiKeyPrincipal, Registry, RegistryError
from clora.ids import SERVED_NAME_RE, Id, new_response_id, parse_served_name, served_name
from clora.web import HttpError, api_key, bearer_token, install_error_handlers, read_body, too_deep
from clora.ingest.schemas import Message
from clora.serving import errors, responses, tinker_sampling
from clora.serving.aliases import AdapterRef
from clora.serving.completions import Kind, Recorder, Unrecordable, recorded_messages, upstream_body
from clora.serving.engine import AdapterLoadError, EngineManager, EngineUnavailable, Lease
from clora.serving.fair_queue import FairQueue, TenantWeights, Ticket
from clora.serving.freshness import FreshnessTracker
from clora.serving.hotswap import HotSwapper
from clora.serving.interactions import InteractionLogger
from clora.serving.metrics import UNAUTHENTICATED, GatewayMetrics
from clora.serving.quota import TenantQuota
from clora.serving.quota_store import QuotaStore
from clora.serving.record_quota import RecordQuota
from clora.serving.request_fields import Bounds, Refused, check_fields
from clora.serving.responses import EventStream, Translated
from clora.serving.settings import GatewaySettings, tenant_limits
from clora.serving.traffic import CLIENT_LEFT

TINKER_SCHEME = "tinker://"
ADAPTER_MISSING_TRIES = 3
"""How often a request is served before a replica's 404 for its adapter reaches the client
(`Gateway._serve`)."""

log = logging.getLogger(__name__)

_METADATA_ID = TypeAdapter(Id)
"""`metadata.group_id` (the rollout group an interaction belongs to) and `metadata.episode_id`
(the agent episode a later turn continues): ids as the events carry them."""

UPSTREAM_BROKEN = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)


@dataclass(frozen=True)
class TenantHolds:
    """What one tenant's requests in flight hold right now; all zero once every one has ended
    (`Gateway.wait_released`)."""

    quota_slots: int
    sequences: int
    version_holds: int
    """Requests in flight to versions other than the live one (`TenantQuota.pinned_in_flight`)."""
    pins: int
    """Adapter pins on the replicas (one per request to one of the tenant's versions)."""

    def empty(self) -> bool:
        return not (self.quota_slots or self.sequences or self.version_holds or self.pins)


@dataclass(frozen=True)
class Admitted:
    """A request that passed the door: its recorded messages and how many bytes it records."""

    messages: list[Message]
    recorded_bytes: int
    """`messages` and `tools` as JSON (the `RecordQuota` charge)."""
    sequences: int
    """`n`: the engine sequences it holds while in flight."""
    max_tokens: int
    """The most tokens each of its sequences generates (what fair admission charges up front)."""


@dataclass(frozen=True)
class Held:
    """What `Gateway._hold` took for one request, each released when its stack closes."""

    lease: Lease
    ticket: Ticket | None
    """Its place in the fair queue (None: `fair_admission` off). The request sets
    `ticket.generated` once it knows, so that its tenant is charged what it got."""


class StreamWriter(Protocol):
    """Writes one streamed answer's server-sent events from the engine's chat or completion
    chunks (as `Recorder.chunk` gives them to the client)."""

    def opening(self) -> bytes: ...
    def chunk(self, obj: dict[str, Any]) -> bytes: ...
    def done(self, prompt_tokens: int, completion_tokens: int) -> bytes: ...
    def error(self, error: dict[str, Any], status: int) -> bytes: ...


class Wire(Protocol):
    """How a served completion goes back to its client: in the shape of the route it was
    asked on (`PassThrough`), or translated (`ResponsesWire`, for `/v1/responses`)."""

    id_prefix: str
    metric_kind: str

    def whole(self, rid: str, out: dict[str, Any]) -> dict[str, Any]: ...
    def stream(self, rid: str, model: str) -> StreamWriter: ...


@dataclass(frozen=True)
class PassThrough:
    """`/v1/chat/completions` and `/v1/completions`: the engine's answer as it is (ids, model
    and extras already set by the `Recorder`)."""

    kind: Kind

    @property
    def id_kind(self) -> str:
        return self.kind

    @property
    def metric_kind(self) -> str:
        return self.kind

    def whole(self, rid: str, out: dict[str, Any]) -> dict[str, Any]:
        return out

    def stream(self, rid: str, model: str) -> "PassThrough":
        return self

    def opening(self) -> bytes:
        return b""

    def chunk(self, obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    def done(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, error: dict[str, Any], status: int) -> bytes:
        return f"data: {json.dumps({'error': error})}\n\n".encode()


@dataclass(frozen=True)
class ResponsesWire:
    """`/v1/responses`: a `response` object, or the Responses API's events (`clora.serving.responses`)."""

    translated: Translated
    id_kind: str = responses.KIND
    metric_kind: str = responses.KIND

    def whole(self, rid: str, out: dict[str, Any]) -> dict[str, Any]:
        return responses.whole(self.translated, rid, out)

    def stream(self, rid: str, model: str) -> EventStream:
        return EventStream(self.translated, rid, model)


class Unrecorded(RuntimeError):
    """A served completion whose interaction event did not become durable."""


SALT_KEY = "clora:gateway:cache_salt_key"
"""The Redis key of the prefix-cache salt key all gateways share."""


def shared_salt_key(client) -> bytes:
    """The prefix-cache salt key every gateway on this Redis uses: the first to start makes it
    (SET NX), the rest read it. Example: two gateways give tenant `acme` the same `cache_salt`,
    so vLLM reuses `acme`'s cached system prompt whichever gateway sent the request; other
    tenants' salts still differ, so nothing is shared across tenants."""
    client.set(SALT_KEY, secrets.token_hex(32), nx=True)
    return bytes.fromhex(client.get(SALT_KEY).decode())


@dataclass
class Gateway:
    settings: GatewaySettings
    registry: Registry
    engine: EngineManager
    swapper: HotSwapper
    logger: InteractionLogger
    quota: TenantQuota | None = None
    """Built from `tenant_limits` on `quota_store` when not given."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    record_quota: RecordQuota | None = None
    """Per-tenant recorded bytes, on `quota_store` when not given."""
    quota_store: QuotaStore | None = None
    """Where both quotas count: Redis, shared by every gateway (`QuotaStore.connect`); this
    process's memory when not given."""
    salt_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Keys each tenant's prefix-cache salt (`cache_salt`); never leaves the gateways. Every
    gateway of a deployment uses the same one (`shared_salt_key`), so a tenant's cached prefixes
    serve its requests through any of them."""
    _released: asyncio.Condition = field(default_factory=asyncio.Condition, init=False)
    """Notified each time a request has released everything it held."""
    freshness: FreshnessTracker | None = None
    """Claims each version's first served completion and measures its feedback's freshness;
    built on the registry and metrics when not given."""

    def __post_init__(self) -> None:
        self.limits = tenant_limits(self.engine.settings, self.settings)
        es = self.engine.settings
        capacity = self.settings.fair_sequences or es.replica_count * es.max_num_seqs
        if capacity < self.limits.n:
            raise ValueError(f"fair_sequences {capacity} is less than the largest n a tenant may ask for "
                             f"({self.limits.n}): such a request could never be sent")
        self.fair = FairQueue(capacity, grace_s=self.settings.fair_grace_s, shares=self.settings.fair_shares)
        """Engine sequences in flight across tenants, and the requests waiting for them (used
        while `settings.fair_admission` is on: a benchmark may turn it off and on)."""
        self.weights = TenantWeights(self.registry, self.settings.tenant_refresh_s)
        if self.quota_store is None:
            self.quota_store = QuotaStore.local()
        if self.quota is None:
            self.quota = TenantQuota(self.limits.requests, self.settings.tenant_rate_per_s, self.settings.tenant_burst,
                                     sequences=self.limits.sequences,
                                     pinned_versions=self.settings.tenant_pinned_versions, store=self.quota_store)
        if self.record_quota is None:
            self.record_quota = RecordQuota(self.quota_store, self.settings.tenant_recorded_bytes_per_s,
                                            self.settings.tenant_recorded_burst_s)
        self.bounds = Bounds(max_tokens=self.limits.max_tokens, n=self.limits.n,
                             max_depth=self.settings.max_json_depth)
        if self.freshness is None:
            self.freshness = FreshnessTracker(self.registry, self.metrics)

    def cache_salt(self, tenant: str) -> str:
        return hmac.new(self.salt_key, tenant.encode(), hashlib.sha256).hexdigest()

    # --- admission ----------------------------------------------------------------------

    async def authenticate(self, request: Request) -> ApiKeyPrincipal:
        key = bearer_token(request.headers)
        if not key:
            raise errors.invalid_api_key()
        principal = await asyncio.to_thread(self.registry.authenticate, key)
        if principal is None:
            raise errors.invalid_api_key()
        return principal

    async def authenticate_tinker(self, request: Request) -> ApiKeyPrincipal:
        """The tenant of the Tinker key (`tml-...`) in `X-API-Key` or `Authorization: Bearer`;
        any other key or token is 401."""
        key = api_key(request.headers)
        principal = await asyncio.to_thread(self.registry.authenticate_tinker, key) if key else None
        if principal is None:
            raise HttpError(401, "invalid_api_key", "a Tinker key (tml-...) is required in X-API-Key")
        return principal

    async def read_json(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.settings.max_body_bytes)
        try:
            body = json.loads(raw)
        except RecursionError as e:  # nests deeper than the parser goes: name the field if we can
            path = too_deep(raw, self.settings.max_json_depth + 1)  # + 1: the body object itself
            name = str(path[0]) if path else None
            raise errors.bad_request(f"{name or 'the request body'} nests deeper than "
                                     f"{self.settings.max_json_depth} levels", name) from e
        except ValueError as e:
            raise errors.bad_request(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise errors.bad_request("request body must be a JSON object")
        return body

    def validate(self, body: dict[str, Any], kind: Kind) -> Admitted:
        """Refuse a request the gateway would not serve or could not record (400 naming the
        field): a field not on the allow-list (`request_fields`), a value out of type or range,
        a record (messages, tools) too deep or too large."""
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise errors.bad_request("you must provide a model parameter", "model")
        if kind == "chat" and body.get("messages") is None:
            raise errors.bad_request("messages must be a non-empty array", "messages")
        if kind == "completion" and body.get("prompt") is None:
            raise errors.bad_request("prompt must be given", "prompt")
        try:
            check_fields(body, kind, self.bounds)
        except Refused as e:
            raise errors.bad_request(f"{e.field}: {e.message}", e.field) from e
        recorded = 0
        for name in ("messages", "tools"):
            if body.get(name) is not None:
                size = len(json.dumps(body[name]))
                if size > self.settings.max_recorded_bytes:
                    raise errors.bad_request(f"{name}: {size} bytes as JSON; at most {self.settings.max_recorded_bytes} "
                                             "are recorded", name)
                recorded += size
        try:
            messages = recorded_messages(body, kind)
        except Unrecordable as e:
            raise errors.bad_request(f"{e.field}: {e.message}", e.field) from e
        if kind == "completion":
            recorded += len(body["prompt"])
        n = body.get("n") or 1
        metadata = body.get("metadata") or {}
        for name in ("group_id", "episode_id"):
            value = metadata.get(name)
            if value is None:
                continue
            try:
                _METADATA_ID.validate_python(value, strict=True)
            except ValidationError as e:
                raise errors.bad_request(f"metadata.{name}: {e.errors()[0]['msg']}, got {value!r}",
                                         f"metadata.{name}") from e
            if name == "episode_id" and n > 1:
                raise errors.bad_request(f"metadata.episode_id: a request with n = {n} starts {n} episodes; it "
                                         "cannot continue one", "metadata.episode_id")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.limits.max_tokens
        return Admitted(messages, recorded, n, max_tokens)

    async def resolve(self, principal: ApiKeyPrincipal, model: str) -> AdapterRef | None:
        """The adapter `model` names for this caller (None: the base model)."""
        if model == self.engine.settings.base_name:
            return None
        if model.startswith(TINKER_SCHEME):  # looked up for the caller's tenant only
            tenant = principal.tenant
            try:
                version = await asyncio.to_thread(self.registry.tinker_sampler_version, tenant, model)
            except RegistryError as e:
                raise errors.model_not_found(model) from e
            if version is None:
                raise errors.model_not_found(model)
        else:
            tenant, version = parse_served_name(model)
            if tenant != principal.tenant:
                raise errors.model_not_found(model)
            if version is None:
                # A tenant's model exists from its creation: the base model until a version is live.
                return await self.swapper.live_ref(tenant)
        try:
            av = await asyncio.to_thread(self.registry.adapter_version, tenant, version)
        except RegistryError as e:
            raise errors.model_not_found(model) from e
        return AdapterRef.of(tenant, av)

    # --- what a request holds -----------------------------------------------------------

    def holds(self, tenant: str) -> TenantHolds:
        pins = sum(r.resident.pins(name) for r in self.engine.replicas for name in r.resident.names()
                   if SERVED_NAME_RE.fullmatch(name) and parse_served_name(name)[0] == tenant)
        return TenantHolds(quota_slots=self.quota.in_flight(tenant), sequences=self.quota.sequences_in_flight(tenant),
                           version_holds=self.quota.pinned_in_flight(tenant), pins=pins)

    async def wait_released(self, tenant: str, timeout_s: float = 30.0) -> TenantHolds:
        """Wait until every request of `tenant` has released what it held (a client sees the end
        of its stream slightly before the gateway releases it); returns the holds then."""
        async with self._released:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._released.wait_for(lambda: self.holds(tenant).empty()), timeout_s)
        return self.holds(tenant)

    async def _notify_released(self) -> None:
        async with self._released:
            self._released.notify_all()

    async def _hold(self, stack: contextlib.AsyncExitStack, tenant: str, ref: AdapterRef | None,
                    sequences: int, max_tokens: int, request: Request | None = None) -> Held:
        """Take everything a request holds, each with its release on `stack`: the quota slot
        (counting a version other than the live one: each pins an adapter slot on a replica, so
        a tenant may have requests in flight to at most `tenant_pinned_versions` of them), its
        place in the fair queue (`sequences` x `max_tokens` tokens charged until it says what it
        generated; a `request` whose client leaves while it waits there gives up), the engine
        lease (and adapter pin), the in-flight gauge. Whoever closes `stack` releases them all,
        on every path."""
        stack.push_async_callback(self._notify_released)  # runs last: after every release below
        pinned = ref.version if ref is not None and ref != await self.swapper.live_ref(tenant) else None
        slot = await self.quota.acquire(tenant, sequences, pinned)
        stack.push_async_callback(self.quota.release, slot)
        ticket = await self._admit(tenant, sequences, max_tokens, request) if self.settings.fair_admission else None
        if ticket is not None:
            stack.callback(self.fair.release, ticket)
        try:
            lease = await stack.enter_async_context(self.engine.lease(ref))
        except EngineUnavailable as e:
            raise errors.unavailable(str(e)) from e
        except AdapterLoadError as e:
            raise errors.unavailable(f"adapter {ref.name if ref else '?'} could not be loaded: {e}") from e
        in_flight = self.metrics.in_flight.labels(tenant)
        in_flight.inc()
        stack.callback(in_flight.dec)
        return Held(lease, ticket)

    async def _admit(self, tenant: str, sequences: int, max_tokens: int, request: Request | None) -> Ticket:
        """Wait for the request's turn in the fair queue: 503 past `fair_wait_s`; `CLIENT_LEFT`
        when `request`'s client hangs up first (the server would not cancel a request that
        answers in one piece), so that an abandoned request never reaches the engine."""
        weight = await self.weights.get(tenant)
        admit = asyncio.ensure_future(self.fair.admit(tenant, sequences, sequences * max_tokens, weight))
        gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
        ticket = None
        try:
            await asyncio.wait({admit} | ({gone} if gone else set()), timeout=self.settings.fair_wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if admit.done():
                ticket = admit.result()
        finally:  # timed out, the client gone, or this request cancelled: its place is given back
            if gone is not None:
                gone.cancel()
            if ticket is None:
                await self._give_up(admit)
        if ticket is not None:
            return ticket
        if gone is not None and gone.done() and not gone.cancelled():
            raise HttpError(CLIENT_LEFT, "client_closed_request", "the client left while its request waited for "
                            "its fair turn")
        raise errors.unavailable(f"the engine is full: tenant {tenant}'s request waited "
                                 f"{self.settings.fair_wait_s:g} s for its fair turn")

    async def _give_up(self, admit: asyncio.Future) -> None:
        """Leave the fair queue: the waiting request is withdrawn (or, sent meanwhile, its
        ticket released)."""
        admit.cancel()
        try:
            ticket = await admit
        except asyncio.CancelledError:
            return
        self.fair.release(ticket)

    # --- completions --------------------------------------------------------------------

    async def complete(self, request: Request, kind: Kind, path: str) -> Response:
        started = time.monotonic()
        return await self._counted(kind, started, self.authenticate(request),
                                   lambda principal: self._complete(principal, request, kind, path, started))

    async def _counted(self, kind: str, started: float, authenticated, serve) -> Response:
        """Answer with `serve(principal)` once `authenticated` gives the principal, counting the
        answer (or the error) in the metrics under `kind`; a stream counts when it ends."""
        tenant = UNAUTHENTICATED
        try:
            principal = await authenticated
            tenant = principal.tenant
            response = await serve(principal)
        except HttpError as e:
            self.metrics.answered(tenant, kind, e.status, time.monotonic() - started)
            raise
        except Exception:
            self.metrics.answered(tenant, kind, 500, time.monotonic() - started)
            raise
        if not isinstance(response, OwnedStream):
            self.metrics.answered(tenant, kind, response.status_code, time.monotonic() - started)
        return response

    async def _complete(self, principal: ApiKeyPrincipal, request: Request, kind: Kind, path: str,
                        started: float) -> Response:
        body = await self.read_json(request)
        return await self._serve(principal, request, body, self.validate(body, kind), kind, path, started,
                                 PassThrough(kind))

    async def respond(self, request: Request) -> Response:
        """`POST /v1/responses`: served as the chat completion it translates to
        (`clora.serving.responses`), with everything a chat completion gets."""
        started = time.monotonic()
        return await self._counted(responses.KIND, started, self.authenticate(request),
                                   lambda principal: self._respond(principal, request, started))

    async def _respond(self, principal: ApiKeyPrincipal, request: Request, started: float) -> Response:
        body = await self.read_json(request)
        try:
            translated = responses.to_chat(body, self.bounds)
        except Refused as e:
            raise errors.bad_request(f"{e.field}: {e.message}", e.field) from e
        try:
            admitted = self.validate(translated.chat, "chat")
        except HttpError as e:  # a chat check's refusal, named as the Responses field
            if e.status != 400 or e.field is None:
                raise
            raise errors.bad_request(*translated.renamed(e.message, e.field)) from e
        return await self._serve(principal, request, translated.chat, admitted, "chat", "/v1/chat/completions",
                                 started, ResponsesWire(translated))

    async def _serve(self, principal: ApiKeyPrincipal, request: Request, body: dict[str, Any], admitted: Admitted,
                     kind: Kind, path: str, started: float, wire: Wire) -> Response:
        """Serve the checked completion request `body` (of `kind`) on the engine's `path`,
        recorded, and answer it through `wire`. A replica that answers 404 for the adapter it was
        believed to hold (another gateway sharing it retired the version, or it restarted between
        health checks: `Engine.adapter_missing`) is asked again, up to `ADAPTER_MISSING_TRIES`
        times in all, after holding again, which loads the adapter where the request goes. A
        request for the tenant's alias first reads the live version again: a peer retires a
        version only once a newer one is live, which this gateway may not have swapped to yet.
        The client sees the 404 only if every try fails."""
        model = body["model"]
        ref = await self.resolve(principal, model)
        await self.record_quota.charge(principal.tenant, admitted.recorded_bytes)
        rid = new_response_id(wire.id_kind)
        tries = 0
        while True:
            tries += 1
            try:
                return await self._serve_once(principal, request, body, admitted, kind, path, started, wire, ref, rid)
            except _AdapterMissing as e:
                if tries == ADAPTER_MISSING_TRIES:
                    return _upstream_error(e.status, e.content)
            if ref is not None and model == principal.tenant:
                await self.swapper.reconcile(principal.tenant)
                ref = await self.swapper.live_ref(principal.tenant)

    async def _serve_once(self, principal: ApiKeyPrincipal, request: Request, body: dict[str, Any],
                          admitted: Admitted, kind: Kind, path: str, started: float, wire: Wire,
                          ref: AdapterRef | None, rid: str) -> Response:
        stack = contextlib.AsyncExitStack()
        try:
            held = await self._hold(stack, principal.tenant, ref, admitted.sequences, admitted.max_tokens, request)
            lease = held.lease
            rec = Recorder(kind=kind, body=body, tenant=principal.tenant, interaction_id=rid, ref=ref,
                           client_model=ref.name if ref else self.engine.settings.base_name,
                           messages=admitted.messages)
            if (ticket := held.ticket) is not None:
                def charge() -> None:  # runs before the ticket's release: the tenant pays what it got
                    ticket.generated = rec.generated_tokens()
                stack.callback(charge)
            await asyncio.to_thread(self.registry.claim_response, rid, principal.tenant, rec.choices_asked)
            up = upstream_body(body, kind, lease.model, self.cache_salt(principal.tenant))
            url = lease.replica.url + path
            if not body.get("stream"):
                return await self._whole(url, up, rec, lease, wire)
            response = await self._stream(url, up, rec, lease, stack, started, wire)
            if isinstance(response, OwnedStream):
                stack = None  # the response owns it now and closes it when it ends, however it ends
            return response
        finally:
            if stack is not None:
                await stack.aclose()

    async def _record(self, rec: Recorder) -> None:
        """Log the interaction events of a finished completion and, with `durable_interactions`,
        wait until each is durable; count its tokens; tell the freshness tracker which version
        answered. Raises `Unrecorded` when an event cannot be built, submitted or made durable in
        `record_timeout_s`."""
        try:
            events = rec.events()
            pending = [self.logger.submit(ev) for ev in events]
        except Exception as e:  # noqa: BLE001 - whatever broke, the answer must not claim it was recorded
            log.exception("interaction %s (tenant %s) could not be recorded", rec.interaction_id, rec.tenant)
            self.metrics.served(rec.tenant, 0, 0, recorded=False)
            raise Unrecorded(f"interaction {rec.interaction_id} could not be recorded: {e!r}") from e
        generated = rec.generated_tokens()
        self.metrics.served(rec.tenant, len(rec.prompt_token_ids or ()), generated,
                            recorded=bool(events) or not rec.choices)
        if self.settings.durable_interactions and pending:
            try:
                await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in pending)),
                                       self.settings.record_timeout_s)
            except (asyncio.TimeoutError, RuntimeError) as e:
                raise Unrecorded(f"interaction {rec.interaction_id} was not durable within "
                                 f"{self.settings.record_timeout_s} s: {e!r}") from e
        if rec.choices:  # answered: the version's first completion starts its freshness measurement
            self.freshness.served(rec.ref)

    def _unrecorded(self, e: Unrecorded) -> HttpError:
        return HttpError(503, "interaction_not_recorded", f"{e}; the answer is withheld: retry", type="server_error",
                         headers={"retry-after": "1"})

    def _upstream_broken(self, lease: Lease, e: Exception, when: str) -> HttpError:
        self.engine.report_error(lease.replica, e)
        return errors.unavailable(f"engine replica {lease.replica.index} failed {when}: {e!r}")

    async def _post(self, url: str, up: dict[str, Any], lease: Lease) -> httpx.Response:
        """POST `up` to the leased replica; its failures as the gateway's 503 or 504."""
        try:
            r = await self.engine.http.post(url, json=up, headers=lease.replica.headers,
                                            timeout=self.settings.upstream_timeout_s)
        except UPSTREAM_BROKEN as e:
            raise self._upstream_broken(lease, e, "mid-request") from e
        except httpx.TimeoutException as e:
            raise errors.timeout(self.settings.upstream_timeout_s) from e
        if r.status_code == 404:
            self.engine.adapter_missing(lease)
        return r

    async def _whole(self, url: str, up: dict[str, Any], rec: Recorder, lease: Lease, wire: Wire) -> Response:
        r = await self._post(url, up, lease)
        if r.status_code == 404 and lease.ref is not None:
            raise _AdapterMissing(r.status_code, r.content)
        if r.status_code != 200:
            return _upstream_error(r.status_code, r.content)
        try:
            out = wire.whole(rec.interaction_id, rec.finish(r.json()))
        except (ValueError, KeyError, TypeError) as e:
            raise HttpError(502, "bad_engine_response", f"engine replica {lease.replica.index} answered something "
                            f"that is not a completion: {e!r}", type="server_error") from e
        try:
            await self._record(rec)
        except Unrecorded as e:
            raise self._unrecorded(e) from e
        return JSONResponse(out)

    async def _stream(self, url: str, up: dict[str, Any], rec: Recorder, lease: Lease,
                      stack: contextlib.AsyncExitStack, started: float, wire: Wire) -> Response:
        try:
            upstream = await stack.enter_async_context(
                self.engine.http.stream("POST", url, json=up, headers=lease.replica.headers,
                                        timeout=self.settings.upstream_timeout_s))
        except UPSTREAM_BROKEN as e:
            raise self._upstream_broken(lease, e, "before its stream began") from e
        except httpx.TimeoutException as e:
            raise errors.timeout(self.settings.upstream_timeout_s) from e
        if upstream.status_code != 200:
            if upstream.status_code == 404:
                self.engine.adapter_missing(lease)
                if lease.ref is not None:
                    raise _AdapterMissing(upstream.status_code, await upstream.aread())
            return _upstream_error(upstream.status_code, await upstream.aread())
        end = StreamEnd()
        writer = wire.stream(rec.interaction_id, rec.client_model)

        def error_event(err: HttpError) -> bytes:
            end.status = err.status
            return writer.error(err.body(errors.SHAPE)["error"], err.status)

        async def relay() -> AsyncIterator[bytes]:
            failed, first = None, True
            try:
                if opening := writer.opening():
                    yield opening
                async for line in upstream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if first:
                        self.metrics.first_token.observe(time.monotonic() - started)
                        first = False
                    data = line[6:]
                    if data.strip() == "[DONE]":
                        if failed is None:
                            try:  # durable before the client sees the end
                                await self._record(rec)
                            except Unrecorded as e:
                                yield error_event(self._unrecorded(e))
                                return
                        end.status = 200 if failed is None else failed
                        if tail := writer.done(len(rec.prompt_token_ids or ()), rec.generated_tokens()):
                            yield tail
                        continue
                    obj = json.loads(data)
                    if "error" in obj:  # vLLM failed the generation: passed on, not recorded
                        failed = _error_status(obj["error"])
                        yield writer.error(obj["error"], failed)
                        continue
                    if events := writer.chunk(rec.chunk(obj)):
                        yield events
            except UPSTREAM_BROKEN as e:
                yield error_event(self._upstream_broken(lease, e, "mid-stream"))
            except httpx.TimeoutException:
                yield error_event(errors.timeout(self.settings.upstream_timeout_s))

        def ended() -> None:
            self.metrics.answered(rec.tenant, wire.metric_kind, end.status, time.monotonic() - started, stream=True)

        stack.callback(ended)
        return OwnedStream(relay(), stack)

    # --- Tinker sampling (clora.serving.tinker_sampling) --------------------------------

    async def tinker_sample(self, request: Request) -> Response:
        return await self._counted(tinker_sampling.KIND, time.monotonic(), self.authenticate_tinker(request),
                                   lambda principal: self._tinker_sample(principal, request))

    async def _tinker_sample(self, principal: ApiKeyPrincipal, request: Request) -> Response:
        body = await self.read_json(request)
        try:
            admitted = tinker_sampling.parse(body, self.limits, self.engine.settings.max_model_len)
        except tinker_sampling.Refused as e:
            raise errors.bad_request(f"{e.field}: {e.message}", e.field) from e
        ref = await self.resolve(principal, admitted.request.model)
        async with contextlib.AsyncExitStack() as stack:
            held = await self._hold(stack, principal.tenant, ref, admitted.engine_n, admitted.max_tokens, request)
            lease = held.lease
            up = tinker_sampling.upstream_body(admitted, lease.model, self.cache_salt(principal.tenant))
            r = await self._post(lease.replica.url + "/v1/completions", up, lease)
            if r.status_code != 200:
                return _upstream_error(r.status_code, r.content)
            try:
                out = tinker_sampling.sample_result(r.json(), admitted)
            except (tinker_sampling.BadEngineResponse, ValueError, KeyError, TypeError, AttributeError) as e:
                raise HttpError(502, "bad_engine_response", f"engine replica {lease.replica.index} answered "
                                f"something that is not the samples asked for: {e!r}", type="server_error") from e
            if held.ticket is not None:
                held.ticket.generated = sum(len(s["tokens"]) for s in out["sequences"])
        self.metrics.served(principal.tenant, len(admitted.request.prompt),
                            sum(len(s["tokens"]) for s in out["sequences"]), recorded=True)
        return JSONResponse(out)

    # --- models -------------------------------------------------------------------------

    async def models(self, principal: ApiKeyPrincipal) -> list[dict[str, Any]]:
        base = self.engine.settings.base_name
        out = [{"id": base, "object": "model", "created": 0, "owned_by": "clora"}]
        versions = await asyncio.to_thread(self.registry.adapter_versions, principal.tenant)
        live = await self.swapper.live_ref(principal.tenant)
        out.append({"id": principal.tenant, "object": "model", "created": int(versions[-1].created_at)
                    if versions else 0, "owned_by": principal.tenant, "root": live.name if live else base,
                    "parent": base})
        for v in versions:
            name = served_name(principal.tenant, v.version)
            out.append({"id": name, "object": "model", "created": int(v.created_at),
                        "owned_by": principal.tenant, "root": name, "parent": base})
        return out


@dataclass
class StreamEnd:
    """How a stream ended, for its metrics: 200, an error status, or `CLIENT_LEFT`."""

    status: int = CLIENT_LEFT


class _AdapterMissing(Exception):
    """A replica's 404 for the adapter a request was leased to it for (`Gateway._serve` asks once
    more). Example: `_AdapterMissing(404, b'{"message": "The model `acme@v1` does not exist."}')`."""

    def __init__(self, status: int, content: bytes):
        super().__init__(f"engine answered {status}")
        self.status, self.content = status, content


class OwnedStream(StreamingResponse):
    """A streamed answer that owns what its request holds (`stack`: quota slot, lease, pins,
    version hold, the upstream stream) and releases it when the response ends, whichever way:
    finished, failed mid-stream, the client gone (even before the first chunk)."""

    def __init__(self, body: AsyncIterator[bytes], stack: contextlib.AsyncExitStack):
        super().__init__(body, media_type="text/event-stream")
        self._stack = stack

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            await self._stack.aclose()


async def _client_gone(request: Request) -> None:
    """Return once the client of `request` (its body read already) has hung up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_status(error: Any) -> int:
    """The HTTP status an error event in vLLM's stream stands for (vLLM puts it in `code`)."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code <= 599 else 500


def _upstream_error(status: int, content: bytes) -> JSONResponse:
    """vLLM's own 4xx/5xx, kept in OpenAI's error shape."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = {"error": {"message": content.decode(errors="replace")[:2000], "type": "server_error"
                          if status >= 500 else "invalid_request_error", "param": None, "code": None}}
    if isinstance(body.get("error"), dict) and isinstance(body["error"].get("code"), int):
        body["error"]["code"] = None  # vLLM puts the HTTP status there; OpenAI uses strings
    return JSONResponse(body, status_code=status)


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="clora gateway", docs_url=None, redoc_url=None)
    install_error_handlers(app, errors.SHAPE)

    async def route_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return errors.route_error(request.method, request.url.path, e.status_code, e.detail,
                                  e.headers).response(errors.SHAPE)

    app.add_exception_handler(StarletteHTTPException, route_error)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = len(gw.engine.healthy())
        return JSONResponse({"healthy_replicas": healthy, "replicas": len(gw.engine.replicas)},
                            status_code=200 if healthy else 503)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.complete(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.complete(request, "completion", "/v1/completions")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await gw.respond(request)

    @app.post(tinker_sampling.PATH)
    async def tinker_sample(request: Request) -> Response:
        return await gw.tinker_sample(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        principal = await gw.authenticate(request)
        return JSONResponse({"object": "list", "data": await gw.models(principal)})

    @app.get("/v1/models/{model}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        principal = await gw.authenticate(request)
        for m in await gw.models(principal):
            if m["id"] == model:
                return JSONResponse(m)
        raise errors.model_not_found(model)

    return app

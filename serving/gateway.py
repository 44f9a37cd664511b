"""The OpenAI-compatible gateway (FastAPI): authentication, tenant -> adapter routing,
quotas, streaming pass-through, interaction logging.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /v1/models/{model}`, `GET /health`.

`model` is the base model name, the caller's tenant id (its live adapter version; the base
model until its first version is live) or a pinned version `tenant@v7`
(`clora.ids.served_name`). Any other tenant's model answers 404 `model_not_found`, exactly
like a model that does not exist. The response `id` is the interaction id: it is claimed in
the registry for the caller's tenant before the response is sent, and feedback names it.
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
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from clora.registry import ApiKeyPrincipal, Registry, RegistryError
from clora.ids import Id, parse_served_name, served_name
from clora.web import HttpError, bearer_token, install_error_handlers, read_body
from clora.ingest.schemas import Message
from clora.serving import errors
from clora.serving.aliases import AdapterRef
from clora.serving.completions import Kind, Recorder, Unrecordable, recorded_messages, upstream_body
from clora.serving.engine import AdapterLoadError, EngineManager, EngineUnavailable
from clora.serving.hotswap import HotSwapper
from clora.serving.interactions import InteractionLogger
from clora.serving.metrics import UNAUTHENTICATED, GatewayMetrics
from clora.serving.quota import TenantQuota
from clora.serving.settings import GatewaySettings
from clora.serving.traffic import CLIENT_LEFT

log = logging.getLogger(__name__)

_METADATA_ID = TypeAdapter(Id)
"""`metadata.group_id` (the rollout group an interaction belongs to) and `metadata.episode_id`
(the agent episode a later turn continues): ids as the events carry them."""

UPSTREAM_BROKEN = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)


@dataclass
class Gateway:
    settings: GatewaySettings
    registry: Registry
    engine: EngineManager
    swapper: HotSwapper
    logger: InteractionLogger
    quota: TenantQuota
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    _held_versions: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter), init=False)
    """tenant -> version -> requests in flight to that version, for versions other than the live one."""
    salt_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Keys each tenant's prefix-cache salt (`cache_salt`); never leaves the gateway."""

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

    async def read_json(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.settings.max_body_bytes)
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise errors.bad_request(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise errors.bad_request("request body must be a JSON object")
        return body

    def validate(self, body: dict[str, Any], kind: Kind) -> list[Message]:
        """Refuse a request the gateway would not serve or could not record (400 naming the
        field); returns its messages as its interaction event will record them."""
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise errors.bad_request("you must provide a model parameter", "model")
        if kind == "chat" and (not isinstance(body.get("messages"), list) or not body["messages"]):
            raise errors.bad_request("messages must be a non-empty array", "messages")
        if kind == "completion" and body.get("prompt") in (None, "", []):
            raise errors.bad_request("prompt must be given", "prompt")
        try:
            messages = recorded_messages(body, kind)
        except Unrecordable as e:
            raise errors.bad_request(f"{e.field}: {e.message}", e.field) from e
        for param in ("max_tokens", "max_completion_tokens"):
            value = body.get(param)
            if value is not None and (not isinstance(value, int) or not 1 <= value <= self.settings.max_tokens_limit):
                raise errors.bad_request(f"{param} must be an integer in [1, {self.settings.max_tokens_limit}], "
                                         f"got {value!r}", param)
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or not 1 <= n <= self.settings.max_n):
            raise errors.bad_request(f"n must be an integer in [1, {self.settings.max_n}], got {n!r}", "n")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise errors.bad_request("metadata must be an object", "metadata")
        for name in ("group_id", "episode_id"):
            value = (metadata or {}).get(name)
            if value is None:
                continue
            try:
                _METADATA_ID.validate_python(value, strict=True)
            except ValidationError as e:
                raise errors.bad_request(f"metadata.{name}: {e.errors()[0]['msg']}, got {value!r}",
                                         f"metadata.{name}") from e
            if name == "episode_id" and (n or 1) > 1:
                raise errors.bad_request(f"metadata.episode_id: a request with n = {n} starts {n} episodes; it "
                                         "cannot continue one", "metadata.episode_id")
        return messages

    async def resolve(self, principal: ApiKeyPrincipal, model: str) -> AdapterRef | None:
        """The adapter `model` names for this caller (None: the base model)."""
        if model == self.engine.settings.base_name:
            return None
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
        return AdapterRef(tenant, av.version, av.path)

    # --- completions --------------------------------------------------------------------

    async def complete(self, request: Request, kind: Kind, path: str) -> Response:
        started, tenant = time.monotonic(), UNAUTHENTICATED
        try:
            principal = await self.authenticate(request)
            tenant = principal.tenant
            response = await self._complete(principal, request, kind, path, started)
        except HttpError as e:
            self.metrics.answered(tenant, kind, e.status, time.monotonic() - started)
            raise
        except Exception:
            self.metrics.answered(tenant, kind, 500, time.monotonic() - started)
            raise
        if not isinstance(response, StreamingResponse):  # a stream counts when it ends
            self.metrics.answered(tenant, kind, response.status_code, time.monotonic() - started)
        return response

    async def _complete(self, principal: ApiKeyPrincipal, request: Request, kind: Kind, path: str,
                        started: float) -> Response:
        body = await self.read_json(request)
        messages = self.validate(body, kind)
        ref = await self.resolve(principal, body["model"])
        self.quota.acquire(principal.tenant)
        stack = contextlib.AsyncExitStack()
        stack.callback(self.quota.release, principal.tenant)
        try:
            if ref is not None and ref != await self.swapper.live_ref(principal.tenant):
                self._hold_version(ref, stack)
            try:
                lease = await stack.enter_async_context(self.engine.lease(ref))
            except EngineUnavailable as e:
                raise errors.unavailable(str(e)) from e
            except AdapterLoadError as e:
                raise errors.unavailable(f"adapter {ref.name if ref else '?'} could not be loaded: {e}") from e
            in_flight = self.metrics.in_flight.labels(principal.tenant)
            in_flight.inc()
            stack.callback(in_flight.dec)
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
            rec = Recorder(kind=kind, body=body, tenant=principal.tenant, interaction_id=rid, ref=ref,
                           client_model=ref.name if ref else self.engine.settings.base_name, messages=messages)
            for iid in rec.interaction_ids():
                await asyncio.to_thread(self.registry.claim_interaction, iid, principal.tenant)
            up = upstream_body(body, kind, lease.model, self.cache_salt(principal.tenant))
            url = lease.replica.url + path
            if body.get("stream"):
                response = await self._stream(url, up, rec, lease, stack, started)
                stack = None  # the stream owns the lease and the quota slot now
                return response
            return await self._whole(url, up, rec, lease)
        finally:
            if stack is not None:
                await stack.aclose()

    def _hold_version(self, ref: AdapterRef, stack: contextlib.AsyncExitStack) -> None:
        """Count an in-flight request to a version other than its tenant's live one. Each pins
        an adapter slot on a replica: a tenant with requests to every one of its old versions
        at once would take every slot from every other tenant, so it may have at most
        `tenant_pinned_versions` of them in flight (a 429 over it)."""
        held, limit = self._held_versions[ref.tenant], self.settings.tenant_pinned_versions
        if ref.version not in held and len(held) >= limit:
            raise errors.rate_limited(f"tenant {ref.tenant} already has requests in flight to {len(held)} versions "
                                      f"other than its live one ({', '.join(f'v{v}' for v in sorted(held))}); at "
                                      f"most {limit} at once", retry_after_s=1)
        held[ref.version] += 1
        stack.callback(self._release_version, ref)

    def _release_version(self, ref: AdapterRef) -> None:
        held = self._held_versions[ref.tenant]
        held[ref.version] -= 1
        if not held[ref.version]:
            del held[ref.version]
        if not held:
            del self._held_versions[ref.tenant]

    def _record(self, rec: Recorder) -> None:
        """Log the interaction events of a finished completion; count its tokens."""
        events = rec.events()
        for ev in events:
            self.logger.submit(ev)
        generated = sum(len(c.token_ids) for c in rec.choices.values())
        self.metrics.served(rec.tenant, len(rec.prompt_token_ids or ()), generated,
                            recorded=bool(events) or not rec.choices)

    async def _whole(self, url: str, up: dict[str, Any], rec: Recorder, lease) -> Response:
        try:
            r = await self.engine.http.post(url, json=up, timeout=self.settings.upstream_timeout_s)
        except UPSTREAM_BROKEN as e:
            self.engine.mark_failed(lease.replica, e)
            raise errors.unavailable(f"engine replica {lease.replica.index} failed mid-request: {e}") from e
        except httpx.TimeoutException as e:
            raise errors.timeout(self.settings.upstream_timeout_s) from e
        if r.status_code != 200:
            return _upstream_error(r.status_code, r.content)
        out = rec.finish(r.json())
        self._record(rec)
        return JSONResponse(out)

    async def _stream(self, url: str, up: dict[str, Any], rec: Recorder, lease,
                      stack: contextlib.AsyncExitStack, started: float) -> Response:
        try:
            upstream = await stack.enter_async_context(
                self.engine.http.stream("POST", url, json=up, timeout=self.settings.upstream_timeout_s))
        except UPSTREAM_BROKEN as e:
            self.engine.mark_failed(lease.replica, e)
            raise errors.unavailable(f"engine replica {lease.replica.index} failed: {e}") from e
        if upstream.status_code != 200:
            content = await upstream.aread()
            await stack.aclose()
            return _upstream_error(upstream.status_code, content)

        async def relay() -> AsyncIterator[bytes]:
            complete, status, first, failed = False, CLIENT_LEFT, True, None
            try:
                async for line in upstream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if first:
                        self.metrics.first_token.observe(time.monotonic() - started)
                        first = False
                    data = line[6:]
                    if data.strip() == "[DONE]":
                        complete, status = True, 200 if failed is None else failed
                        yield b"data: [DONE]\n\n"
                        continue
                    obj = json.loads(data)
                    if "error" in obj:  # vLLM failed the generation: passed on, not recorded
                        failed = _error_status(obj["error"])
                        yield f"data: {json.dumps(obj)}\n\n".encode()
                        continue
                    yield f"data: {json.dumps(rec.chunk(obj))}\n\n".encode()
            except UPSTREAM_BROKEN as e:
                self.engine.mark_failed(lease.replica, e)
                err = errors.unavailable(f"engine replica {lease.replica.index} failed mid-stream: {e}")
                status = err.status
                yield f"data: {json.dumps(err.body(errors.SHAPE))}\n\n".encode()
            except httpx.TimeoutException:
                err = errors.timeout(self.settings.upstream_timeout_s)
                status = err.status
                yield f"data: {json.dumps(err.body(errors.SHAPE))}\n\n".encode()
            finally:
                if complete and failed is None:
                    self._record(rec)
                self.metrics.answered(rec.tenant, rec.kind, status, time.monotonic() - started, stream=True)
                await stack.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

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

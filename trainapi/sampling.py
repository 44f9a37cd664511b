"""Sampling for the Tinker-compatible training API: sampling sessions, and `asample` run on clora's
shared multi-LoRA engine through the gateway (docs/tinker-protocol.md §4.5, §7.5).

    install_sampling(app, api)    registers the routes below on the app `create_app` builds

| route                                 | answers |
|---------------------------------------|---------|
| `POST /api/v1/create_sampling_session` | `{sampling_session_id}` for `model_path` (a `sampler_weights` path the tenant saved) or `base_model` |
| `GET /api/v1/samplers/{id}`            | `{sampler_id, base_model, model_path}` (0.38 calls it when the client has no base model) |
| `POST /api/v1/asample`                 | a future `{request_id, sample_sequence_ids}` (one id per sample); its result is a `SampleResponse` |

`compute_logprobs` is an `asample` with `max_tokens=1` and `prompt_logprobs`. The flag-gated
routes (`join_sampling_session`, `retrieve_futures`, `cancel_future`) stay off: `client/config`
leaves their flags false.

**Sampling sessions** are Redis records, so that the learner process can create one (the
ephemeral `save_weights_for_sampler`) and this service serve it. This module owns their keys:

    clora:tinker:sampling:{sampling session id}        JSON of `SamplingSession` (TTL `SESSION_TTL_S`)
    clora:tinker:asample:{sampling session id}:{seq}   JSON of the answer to that `asample` (TTL): a
                                                       resent POST (after a 429, a 5xx, a lost
                                                       connection) gets the same request again

A sampling session id is `{session_id}:sample:{sampling_session_seq_id}` (`sampling_session_id_of`),
the counter the SDK shares between `create_sampling_session` and the ephemeral save, so ids never
collide and a retried create gets the same id. Its `served_model` is what the gateway serves: the
version the weights were published as (`tenant@vN`, `clora.ids.served_name`; never live), or the
base model's gateway name. Another tenant's session id is answered as unknown (404).

**The gateway** runs each sample (`clora.serving.tinker_sampling`): this service forwards the
caller's own Tinker key, and the gateway authenticates it and resolves the model for that key's
tenant itself. So this service holds no credential of its own, and a tenant's key can only ever
sample its own tenant's weights, whatever a session record says. The gateway's 429s and 503s
(quota, engine restarting) are waited out in the background until `sample_timeout_s`; a request
it refuses fails the future (category `user`) with its message.

**Results** finish the request's future in Redis (`clora.trainapi.queue.create_future` and
`complete`, kind `sample`) as both the `SampleResponse` protobuf (`sample_response_proto`), which
`retrieve_future` answers a client that accepts it (every SDK since 0.25 asks for it), and its
JSON form for older SDKs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import httpx
import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from clora.ids import served_name
from clora.registry import fetch_tinker_sampler_version
from clora.serving.tinker_sampling import PATH as GATEWAY_PATH, stop_kind
from clora.trainapi import queue
from clora.trainapi.settings import TrainApiSettings
from clora.trainapi.weights import parse_path
from clora.trainapi.wire import WireError, message_class
from clora.web import HttpError, Utf8Str

log = logging.getLogger(__name__)

V1 = "/api/v1"
SESSION_TTL_S = 7 * 86400
"""How long a sampling session lives after it was created or last sampled."""
SESSION_KEY = "clora:tinker:sampling:"
ASAMPLE_KEY = "clora:tinker:asample:"
_STOP_REASONS = {"stop": 0, "length": 1}
"""`tinker_public.StopReason`: STOP_REASON_STOP, STOP_REASON_LENGTH."""
SampleResponseMessage = message_class("SampleResponse")


# --- sampling sessions (Redis) -------------------------------------------------------------

@dataclass(frozen=True)
class SamplingSession:
    """One sampling session. Example: `SamplingSession(tenant="acme", served_model="acme@v7",
    model_path="tinker://9f..:train:0/sampler_weights/final")`; an ephemeral save's has
    `model_path` None, a base-model session `served_model` "base"."""

    tenant: str
    served_model: str
    """What the gateway serves: `tenant@vN`, or the base model's gateway name."""
    model_path: str | None = None
    """The `tinker://` path it was created from, when it was."""


def sampling_session_id_of(session_id: str, sampling_session_seq_id: int) -> str:
    """`sampling_session_id_of("9f..", 3)` is `"9f..:sample:3"`."""
    return f"{session_id}:sample:{int(sampling_session_seq_id)}"


def _session_json(tenant: str, served_model: str, model_path: str | None) -> str:
    return json.dumps(asdict(SamplingSession(tenant, served_model, model_path)))


def _session_of(raw: bytes | str | None) -> SamplingSession | None:
    return None if raw is None else SamplingSession(**json.loads(raw))


def put_sampling_session(r, sid: str, tenant: str, served_model: str, model_path: str | None = None,
                         ttl_s: int = SESSION_TTL_S) -> None:
    """Record sampling session `sid` on a `redis.Redis` (the learner's executor, after an
    ephemeral `save_weights_for_sampler` published `served_model`)."""
    r.set(SESSION_KEY + sid, _session_json(tenant, served_model, model_path), ex=ttl_s)


def get_sampling_session(r, sid: str) -> SamplingSession | None:
    """Sampling session `sid` from a `redis.Redis`; None when unknown or expired."""
    return _session_of(r.get(SESSION_KEY + sid))


async def aput_sampling_session(r, sid: str, tenant: str, served_model: str, model_path: str | None = None,
                                ttl_s: int = SESSION_TTL_S) -> None:
    """`put_sampling_session` on a `redis.asyncio.Redis`."""
    await r.set(SESSION_KEY + sid, _session_json(tenant, served_model, model_path), ex=ttl_s)


async def aget_sampling_session(r, sid: str) -> SamplingSession | None:
    """`get_sampling_session` on a `redis.asyncio.Redis`."""
    return _session_of(await r.get(SESSION_KEY + sid))


# --- results -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SampledSequence:
    """One sample. Example: tokens [5, 9, 2], logprobs [-0.3, -1.2, -0.1], stop_reason "stop"."""

    tokens: list[int]
    logprobs: list[float]
    """Each sampled token's logprob, one per token."""
    stop_reason: Literal["stop", "length"]


@dataclass(frozen=True)
class SampleResult:
    """An `asample`'s result: its sequences in order, and the prompt's logprobs when asked
    (one per prompt token; None at position 0 and wherever `prompt_logprobs_last_n` left a
    token unscored)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None

    def as_json(self) -> dict[str, Any]:
        """The JSON `SampleResponse` SDKs before 0.25 read."""
        return {"type": "sample", "sequences": [asdict(s) for s in self.sequences],
                "prompt_logprobs": self.prompt_logprobs}


def sample_response_proto(result: SampleResult) -> bytes:
    """`result` as the `SampleResponse` protobuf the SDK decodes: tokens int32 LE, logprobs
    float32 LE, prompt logprobs float32 LE with NaN where None."""
    msg = SampleResponseMessage()
    for s in result.sequences:
        seq = msg.sequences.add()
        seq.stop_reason = _STOP_REASONS[s.stop_reason]
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if x is None else x for x in result.prompt_logprobs],
                                         dtype="<f4").tobytes()
    return msg.SerializeToString()


# --- request bodies --------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class ModelInputBody(_Body):
    chunks: list[dict[str, Any]]


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0, le=1)

    _stop = field_validator("stop", mode="before")(stop_kind)


class AsampleRequest(_Body):
    sampling_session_id: Utf8Str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    """Legacy form, without a sampling session."""
    model_path: str | None = None
    """Legacy form, without a sampling session."""
    num_samples: int = Field(default=1, ge=1)
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


def prompt_tokens(prompt: ModelInputBody) -> list[int]:
    """The prompt's text chunks concatenated; a 400 naming the chunk for anything else."""
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise HttpError(400, "invalid_request", f"prompt.chunks.{i}: {kind!r} chunks are not supported: text only",
                            f"prompt.chunks.{i}")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in values):
            raise HttpError(400, "invalid_request", f"prompt.chunks.{i}.tokens: must be a list of token ids "
                            "(integers >= 0)", f"prompt.chunks.{i}.tokens")
        tokens += values
    if not tokens:
        raise HttpError(400, "invalid_request", "prompt: holds no tokens", "prompt")
    return tokens


def check_unsupported(body: AsampleRequest, n_prompt: int) -> None:
    """400 naming the first field asking for what clora's engine does not give."""
    for field, asked in (("topk_prompt_logprobs", body.topk_prompt_logprobs > 0),
                         ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
                         ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
                         ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
                         ("record_stability_info", bool(body.record_stability_info))):
        if asked:
            raise HttpError(400, "unsupported_field", f"{field}: not supported by this server", field)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise HttpError(400, "invalid_request", "prompt_logprobs_last_n: needs prompt_logprobs",
                            "prompt_logprobs_last_n")
        if not 1 <= last_n <= n_prompt - 1:
            raise HttpError(400, "invalid_request", f"prompt_logprobs_last_n: must be 1..{n_prompt - 1} for a "
                            f"{n_prompt}-token prompt, got {last_n}", "prompt_logprobs_last_n")


def gateway_body(served_model: str, tokens: list[int], body: AsampleRequest) -> dict[str, Any]:
    """The request to the gateway's Tinker route (`clora.serving.tinker_sampling.SampleRequest`)."""
    p = body.sampling_params
    out: dict[str, Any] = {"model": served_model, "prompt": tokens, "num_samples": body.num_samples,
                           "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                           "top_k": p.top_k, "stop": p.stop, "prompt_logprobs": bool(body.prompt_logprobs)}
    if p.seed is not None:
        out["seed"] = p.seed
    return out


# --- the gateway -----------------------------------------------------------------------------

class SampleFailed(RuntimeError):
    """A sample that will not be answered; `category` is the failed future's (`user`, `server`)."""

    def __init__(self, message: str, category: Literal["user", "server"]):
        super().__init__(message)
        self.category = category


def _gateway_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500]


class GatewaySampler:
    """Runs samples on the gateway's Tinker route with the caller's key, waiting out its 429s
    and 503s (and a gateway that is restarting) until `timeout_s`."""

    def __init__(self, http: httpx.AsyncClient, url: str, timeout_s: float):
        self.http, self.url, self.timeout_s = http, url.rstrip("/") + GATEWAY_PATH, timeout_s

    async def sample(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        last, attempt = "nothing", 0
        while (left := deadline - time.monotonic()) > 0:
            wait = min(0.25 * 2 ** min(attempt, 5), 5.0)
            try:
                r = await self.http.post(self.url, json=body, headers={"x-api-key": key}, timeout=left)
            except httpx.TimeoutException as e:
                raise SampleFailed(f"the gateway did not answer within {self.timeout_s:g} s", "server") from e
            except httpx.TransportError as e:
                last = f"the gateway could not be reached: {e!r}"
            else:
                if r.status_code == 200:
                    return r.json()
                message = _gateway_message(r)
                if r.status_code not in (429, 503):
                    category = "user" if 400 <= r.status_code < 500 else "server"
                    raise SampleFailed(message if category == "user" else f"the gateway answered "
                                       f"{r.status_code}: {message}", category)
                last = message
                with contextlib.suppress(ValueError):
                    wait = min(max(float(r.headers.get("retry-after", "")), 0.05), 10.0)
            attempt += 1
            await asyncio.sleep(max(0.0, min(wait, deadline - time.monotonic())))
        raise SampleFailed(f"not sampled within {self.timeout_s:g} s; last: {last}", "server")


def sample_result(answer: dict[str, Any], body: AsampleRequest) -> SampleResult:
    """The gateway's answer as this request's result: `num_samples` sequences, and the prompt's
    logprobs masked to the last `prompt_logprobs_last_n` when that was asked."""
    sequences = [SampledSequence([int(t) for t in s["tokens"]], [float(x) for x in s["logprobs"]],
                                 s["stop_reason"]) for s in answer["sequences"]]
    if len(sequences) != body.num_samples or any(len(s.tokens) != len(s.logprobs) or
                                                 s.stop_reason not in _STOP_REASONS for s in sequences):
        raise SampleFailed(f"the gateway answered {len(sequences)} malformed or missing sequences for "
                           f"{body.num_samples} samples", "server")
    prompt = answer.get("prompt_logprobs") if body.prompt_logprobs else None
    if prompt is not None and body.prompt_logprobs_last_n is not None:
        cut = len(prompt) - body.prompt_logprobs_last_n
        prompt = [None] * cut + prompt[cut:]
    return SampleResult(sequences, prompt)


# --- the routes ------------------------------------------------------------------------------

class Api(Protocol):
    """What the routes use of the app's `TrainApi`."""

    settings: TrainApiSettings
    redis: Any
    """A `redis.asyncio.Redis` (the requests' futures are there too: `clora.trainapi.queue`)."""

    async def tenant(self, request: Request) -> str: ...
    def session(self, tenant: str, session_id: str) -> Any: ...


def install_sampling(app: FastAPI, api: Api, *, gateway: httpx.AsyncClient | None = None) -> None:
    """Register the sampling routes on `app`. `gateway`: the HTTP client samples go out on (a
    test passes one on an in-process gateway); one to `api.settings.gateway_url` otherwise,
    closed with the app, as are samples still running."""
    settings = api.settings
    http = gateway or httpx.AsyncClient(limits=httpx.Limits(max_connections=1024))
    sampler = GatewaySampler(http, settings.gateway_url, settings.sample_timeout_s)
    running: set[asyncio.Task] = set()
    in_flight: Counter[str] = Counter()
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI):
        async with inner(a) as state:
            yield state
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if gateway is None:
                await http.aclose()

    app.router.lifespan_context = lifespan

    async def resolve(tenant: str, base_model: str | None, model_path: str | None) -> SamplingSession:
        """What a sampling session of `model_path` (a `sampler_weights` path of `tenant`) or of
        `base_model` serves; 400 or 404 naming the field."""
        if base_model is not None and base_model != settings.base_model:
            raise HttpError(400, "unsupported_model", f"base_model: {base_model!r} is not served here; use "
                            f"{settings.base_model!r}", "base_model")
        if model_path is None:
            if base_model is None:
                raise HttpError(400, "invalid_request", "model_path or base_model is required", "model_path")
            return SamplingSession(tenant, settings.gateway_base_model)
        field = "model_path"
        try:
            p = parse_path(model_path, field)
        except WireError as e:
            raise HttpError(400, "invalid_path", str(e), field) from e
        if p.kind != "sampler_weights":
            raise HttpError(400, "invalid_path", f"{field}: {model_path!r} is a {p.kind} path; sampling takes a "
                            "sampler_weights path (save_weights_for_sampler)", field)
        version = await fetch_tinker_sampler_version(api.redis, tenant, str(p))
        if version is None:
            raise HttpError(404, "checkpoint_not_found", f"{field}: no sampler weights {model_path!r}", field)
        return SamplingSession(tenant, served_name(tenant, version), str(p))

    async def owned(tenant: str, sid: str) -> SamplingSession:
        s = await aget_sampling_session(api.redis, sid)
        if s is None or s.tenant != tenant:
            raise HttpError(404, "sampling_session_not_found", f"no sampling session {sid!r}",
                            "sampling_session_id")
        return s

    @app.post(f"{V1}/create_sampling_session")
    async def create_sampling_session(request: Request, body: CreateSamplingSessionRequest) -> dict:
        tenant = await api.tenant(request)
        session = api.session(tenant, body.session_id)
        target = await resolve(tenant, body.base_model, body.model_path)
        sid = sampling_session_id_of(session.session_id, body.sampling_session_seq_id)
        await aput_sampling_session(api.redis, sid, tenant, target.served_model, target.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get(f"{V1}/samplers/{{sampling_session_id}}")
    async def get_sampler(request: Request, sampling_session_id: str) -> dict:
        s = await owned(await api.tenant(request), sampling_session_id)
        return {"sampler_id": sampling_session_id, "base_model": settings.base_model, "model_path": s.model_path}

    @app.post(f"{V1}/asample")
    async def asample(request: Request, body: AsampleRequest) -> dict:
        tenant = await api.tenant(request)
        key = request.headers.get("x-api-key", "")
        if body.sampling_session_id is not None:
            target = await owned(tenant, body.sampling_session_id)
        else:
            target = await resolve(tenant, body.base_model, body.model_path)
        tokens = prompt_tokens(body.prompt)
        check_unsupported(body, len(tokens))
        if body.num_samples > settings.max_num_samples:
            raise HttpError(400, "invalid_request", f"num_samples: at most {settings.max_num_samples} per "
                            f"request, got {body.num_samples}", "num_samples")
        resent = None
        if body.sampling_session_id is not None and body.seq_id is not None:
            resent = f"{ASAMPLE_KEY}{body.sampling_session_id}:{body.seq_id}"
            if (raw := await api.redis.get(resent)) is not None:
                return json.loads(raw)
        if in_flight[tenant] >= settings.max_samples_in_flight:
            raise HttpError(429, "too_many_samples", f"{in_flight[tenant]} samples of this tenant are running "
                            f"(at most {settings.max_samples_in_flight}); retry", headers={"retry-after": "1"})
        rid = str(uuid.uuid4())
        answer = {"request_id": rid, "model_id": None,
                  "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
        if resent is not None and not await api.redis.set(resent, json.dumps(answer), nx=True,
                                                          ex=int(settings.future_ttl_s)):
            return json.loads(await api.redis.get(resent))   # a concurrent copy won: its request it is
        await queue.create_future(api.redis, rid, tenant, None, "sample", api.settings.future_ttl_s)
        if body.sampling_session_id is not None:
            await api.redis.expire(SESSION_KEY + body.sampling_session_id, SESSION_TTL_S)
        in_flight[tenant] += 1
        task = asyncio.create_task(run(rid, tenant, key, gateway_body(target.served_model, tokens, body), body))
        running.add(task)
        task.add_done_callback(running.discard)
        return answer

    async def finish(rid: str, **outcome: Any) -> None:
        await queue.complete(api.redis, rid, settings.future_ttl_s, **outcome)

    async def run(rid: str, tenant: str, key: str, up: dict[str, Any], body: AsampleRequest) -> None:
        try:
            result = sample_result(await sampler.sample(key, up), body)
        except SampleFailed as e:
            await finish(rid, error=str(e), category=e.category)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await finish(rid, error="the training API stopped before the sample finished", category="server")
            raise
        except Exception as e:  # noqa: BLE001 - the future must finish, whatever broke
            log.error("sample %s of %s failed", rid, tenant, exc_info=e)
            await finish(rid, error=f"{type(e).__name__}: {e}", category="server")
        else:
            await finish(rid, result=sample_response_proto(result), result_json=result.as_json())
        finally:
            in_flight[tenant] -= 1

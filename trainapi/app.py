"""The Tinker-compatible HTTP door: the routes the official `tinker` SDK 0.38 calls, under `/api/v1`.

    create_app(settings, authenticate, redis) -> FastAPI

`authenticate` maps an `X-API-Key` to its tenant (`Registry.authenticate_tinker`: only `tml-`
keys; tenant keys and admin tokens never open this door). Every error is a non-empty JSON body
in clora's shape naming the field (`clora.web.HttpError`): the SDK treats an empty 400 as a
network fault and retries it. No logic error is 409, which the SDK retries too.

Routes (docs/tinker-protocol.md §4, §11): the handshake (`client/config`, `client/dynamic_config`,
`telemetry`), sessions (`create_session`, `session_heartbeat`, `sessions/{id}/finish`,
`get_server_capabilities`, `healthz`), models (`create_model`, `get_info`), training
(`forward_backward`, `optim_step`), weights (`save_weights`, `save_weights_for_sampler`,
`load_weights`, `weights_info`), sampling (`clora.trainapi.sampling`) and `retrieve_future`.

This process holds no model. A request is checked here (against the capabilities the learner
published, `queue.read_caps`), put in its model's `seq_id` order (`Sequencer`) and enqueued in
Redis (`clora.trainapi.queue`); the learner runs it when its scheduler picks the run
(`clora.trainapi.executor`) and records the outcome, which `retrieve_future` long-polls. Every
checkpoint path resolves under the asking tenant's own folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from clora.registry import ApiKeyPrincipal
from clora.storage import StorageError, StorageSettings
from clora.trainapi import queue
from clora.trainapi.backend import LoraCapabilities, run_key
from clora.trainapi.losses import check_call
from clora.trainapi.sampling import install_sampling, sampling_session_id_of
from clora.trainapi.runs import RunStore, Session, TinkerModel, model_id_of
from clora.trainapi.sequencer import Admitted, Sequencer, SeqError
from clora.trainapi.settings import TrainApiSettings
from clora.trainapi.weights import KINDS as KINDS_ALL, CheckpointDir, CheckpointInfo, NotFound, TinkerPath, \
    check_name, parse_path
from clora.trainapi.wire import WireError, decode_forward_backward, decompress
from clora.web import BodyLimit, HttpError, Utf8Str, body_too_large, install_error_handlers, read_body

log = logging.getLogger(__name__)

Authenticate = Callable[[str], ApiKeyPrincipal | None]
PROTOBUF = "application/x-protobuf"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionRequest(_Body):
    session_id: str


class CreateSessionRequest(_Body):
    sdk_version: str | None = None


class FinishRequest(_Body):
    reason: dict[str, Any] | None = None


class LoraConfig(_Body):
    rank: int = Field(ge=1)
    seed: int | None = Field(default=None, ge=-2**63, le=2**64 - 1)
    """The LoRA init's seed, in the range torch's generator takes (the learner's create would fail)."""
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = "adamw"


class CreateModelRequest(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfig
    optimizer_config: OptimizerConfig | None = None


class ModelRequest(_Body):
    model_id: str


class AdamParamsBody(_Body):
    learning_rate: float = Field(ge=0, le=10)
    beta1: float = Field(ge=0, lt=1)
    beta2: float = Field(ge=0, lt=1)
    eps: float = Field(gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStepRequest(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    """The checkpoint's name (not a tinker:// path); None: one is generated."""
    overwrite: bool = False


class SaveForSamplerRequest(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    """The name; None is the ephemeral form (with `sampling_session_seq_id`)."""
    sampling_session_seq_id: int | None = Field(default=None, ge=0)


class LoadWeightsRequest(_Body):
    """Form B `{model_id, seq_id}` loads into a model in its order; form A `{session_id,
    model_seq_id}` creates the model from the checkpoint (docs/tinker-protocol.md §4.4)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0)
    base_model: str | None = None


class WeightsInfoRequest(_Body):
    tinker_path: str


class RetrieveRequest(_Body):
    request_id: Utf8Str
    allow_metadata_only: bool = False


class TrainApi:
    """The service's state: sessions and models (this process's memory), and the Redis client
    its requests and their futures go through."""

    def __init__(self, settings: TrainApiSettings, authenticate: Authenticate, redis,
                 storage: StorageSettings | None = None):
        self.settings, self.authenticate, self.redis = settings, authenticate, redis
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TinkerModel] = {}
        self.checkpoints = CheckpointDir(settings.checkpoints_dir, storage)
        self.runs = RunStore(redis, settings.max_seq_ids_kept)
        self._enqueue_locks: dict[str, asyncio.Lock] = {}
        self.finished = queue.FinishedWaiter(redis)

    # --- ownership ------------------------------------------------------------------------

    async def tenant(self, request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        principal = await run_in_threadpool(self.authenticate, key) if key else None
        if principal is None:
            raise HttpError(401, "unauthorized", "a valid Tinker key (tml-...) is required in X-API-Key",
                            "X-API-Key")
        return principal.tenant

    def session(self, tenant: str, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise HttpError(404, "session_not_found", f"no session {session_id!r}", "session_id")
        return s

    def model(self, tenant: str, model_id: str) -> TinkerModel:
        m = self.models.get(model_id)
        if m is None or m.tenant != tenant:
            raise HttpError(404, "model_not_found", f"no model {model_id!r}", "model_id")
        return m

    async def caps(self) -> LoraCapabilities:
        """What the learner can hold; 503 until a learner has started and said so."""
        caps = await queue.read_caps(self.redis)
        if caps is None:
            raise HttpError(503, "learner_unavailable", "no learner has started yet; retry shortly", "base_model")
        return LoraCapabilities(**caps)

    def checkpoint(self, tenant: str, path: str, kinds: tuple[str, ...] = ("weights",),
                   field: str = "path") -> tuple[TinkerPath, CheckpointInfo]:
        """`tenant`'s checkpoint at `path`: 400 for a malformed path or another kind, 404 for
        one it does not have (another tenant's included)."""
        try:
            p = parse_path(path, field)
        except WireError as e:
            raise HttpError(400, "invalid_path", str(e), field) from e
        if p.kind not in kinds:
            raise HttpError(400, "invalid_path", f"{field}: {path!r} is a {p.kind} path; this call takes "
                            f"{' or '.join(kinds)}", field)
        try:
            info = self.checkpoints.info(tenant, p, field)
        except NotFound as e:
            raise HttpError(404, "checkpoint_not_found", str(e), field) from e
        except StorageError as e:
            raise HttpError(503, "storage_unavailable", f"{field}: the checkpoint store could not be read: {e}",
                            field) from e
        return p, info

    # --- running requests -------------------------------------------------------------------

    async def enqueue(self, m: TinkerModel, rid: str, kind: queue.Kind, op: str, args: dict[str, Any],
                      payload: bytes | None = None, seq_id: int | None = None) -> None:
        """Hand request `rid` of `m` (its `seq_id`, recorded in the same transaction) to the
        learner, after every request of `m` accepted before it (the lock is taken in the order
        of acceptance: an unheld asyncio lock is taken without yielding)."""
        also = self.runs.seq_ops(m, seq_id, Admitted(request_id=rid)) if seq_id is not None else None
        async with self._lock(m):
            await queue.enqueue(self.redis, m.key, rid, m.tenant, m.model_id, kind, op, args, payload, also=also)

    async def refused(self, m: TinkerModel, seq_id: int, status: int, field: str, message: str) -> None:
        """`seq_id` of `m` was refused: in memory and, in order with its neighbours, in Redis."""
        m.sequencer.refuse(seq_id, status, field, message)
        async with self._lock(m):
            await self.runs.record_seq(m, seq_id, Admitted(refused=(status, field, message)))

    def _lock(self, m: TinkerModel) -> asyncio.Lock:
        return self._enqueue_locks.setdefault(m.model_id, asyncio.Lock())

    async def restore(self) -> None:
        """Sessions, models and their seq_id order as a previous process left them."""
        sessions, models = await self.runs.load()
        self.sessions.update(sessions)
        self.models.update(models)
        if models:
            log.info("restored %d sessions and %d models", len(sessions), len(models))

    async def sequenced(self, m: TinkerModel, seq_id: int, kind: queue.Kind, check: Callable[[], None],
                        op: str, args: Callable[[], dict[str, Any]] | dict[str, Any],
                        payload: bytes | None = None) -> dict:
        """The future of request `seq_id` of model `m`: a retry's own again; else, once `check`
        passes, a new request `op` with `args` for the learner, in order. `check`'s refusal uses
        up the seq_id."""
        try:
            seen = m.sequencer.check(seq_id)
        except SeqError as e:
            raise HttpError(400, "seq_id_out_of_order", str(e), "seq_id") from e
        if seen is not None:
            if seen.refused is not None:
                status, field, message = seen.refused
                raise HttpError(status, "invalid_request", message, field)
            return {"request_id": seen.request_id, "model_id": m.model_id}
        try:
            check()
        except WireError as e:
            await self.refused(m, seq_id, 400, e.field, str(e))
            raise HttpError(400, "invalid_request", str(e), e.field) from e
        except HttpError as e:
            await self.refused(m, seq_id, e.status, e.field, e.message)
            raise
        rid = str(uuid.uuid4())
        m.sequencer.accept(seq_id, rid)
        await self.enqueue(m, rid, kind, op, args() if callable(args) else args, payload, seq_id=seq_id)
        return {"request_id": rid, "model_id": m.model_id}

    def render(self, o: queue.Outcome, accept: str) -> Response:
        if o.state == "failed":
            return JSONResponse({"error": o.error, "category": o.category})
        if o.kind != "json" and o.result is not None and PROTOBUF in accept:
            return Response(o.result, media_type=PROTOBUF)
        return JSONResponse(o.result_json)


ADAM_FIELDS = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}


def _seed(model_id: str) -> int:
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little")


def create_app(settings: TrainApiSettings, authenticate: Authenticate, redis,
               storage: StorageSettings | None = None) -> FastAPI:
    """The app on `redis` (a `redis.asyncio.Redis` without decoded responses)."""
    api = TrainApi(settings, authenticate, redis, storage)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await api.restore()
        api.finished.start()
        yield
        api.finished.close()

    app = FastAPI(title="clora Tinker-compatible training API", lifespan=lifespan)
    app.state.trainapi = api
    install_error_handlers(app, "clora")
    # every body, JSON or protobuf, is refused over the limit before a route reads it
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, shape="clora")

    v1 = "/api/v1"

    # --- handshake ----------------------------------------------------------------------------

    @app.post(f"{v1}/client/config")
    async def client_config(request: Request) -> dict:
        await api.tenant(request)
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": settings.compress_fwdbwd,
                "fwdbwd_max_chunk_len": settings.fwdbwd_max_chunk_len,
                "fwdbwd_max_chunk_bytes_count": settings.fwdbwd_max_chunk_bytes,
                "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
                "custom_loss_server_side": False}

    @app.post(f"{v1}/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        await api.tenant(request)
        return {}

    @app.post(f"{v1}/telemetry")
    async def telemetry(request: Request) -> dict:
        await api.tenant(request)
        return {"status": "accepted"}   # dropped

    @app.get(f"{v1}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        await api.tenant(request)
        return {"supported_models": [{"model_name": settings.base_model,
                                      "max_context_length": settings.max_context_length,
                                      "trainable": True, "sampleable": True}]}

    # --- sessions -----------------------------------------------------------------------------

    @app.post(f"{v1}/create_session")
    async def create_session(request: Request, body: CreateSessionRequest) -> dict:
        tenant = await api.tenant(request)
        s = Session(session_id=str(uuid.uuid4()), tenant=tenant, sdk_version=body.sdk_version)
        api.sessions[s.session_id] = s
        await api.runs.save_session(s)
        return {"type": "create_session", "session_id": s.session_id}

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request, body: SessionRequest) -> dict:
        tenant = await api.tenant(request)
        s = api.sessions.get(body.session_id)
        if s is not None:
            api.session(tenant, body.session_id)   # another tenant's: 404
        if s is None or s.finished is not None:
            raise HttpError(410, "session_gone", f"session {body.session_id!r} is finished or unknown",
                            "session_id")
        s.last_heartbeat = time.time()   # in memory only: a restart must not forget a live session
        return {"type": "session_heartbeat"}

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(request: Request, session_id: str, body: FinishRequest) -> dict:
        s = api.session(await api.tenant(request), session_id)
        s.finished = str((body.reason or {}).get("type", "success"))
        await api.runs.save_session(s)
        return {}

    # --- models -------------------------------------------------------------------------------

    @app.post(f"{v1}/create_model")
    async def create_model(request: Request, body: CreateModelRequest) -> dict:
        tenant = await api.tenant(request)
        s = api.session(tenant, body.session_id)
        model_id = model_id_of(s.session_id, body.model_seq_id)
        existing = api.models.get(model_id)
        if existing is not None:   # a retried POST
            return {"request_id": existing.create_request_id, "model_id": model_id}
        caps, lora = await api.caps(), body.lora_config
        if body.base_model != settings.base_model:
            raise HttpError(400, "unsupported_model", f"base_model {body.base_model!r} is not served here; "
                            f"use {settings.base_model!r}", "base_model")
        if lora.rank != caps.rank:
            raise HttpError(400, "unsupported_rank", f"this learner holds rank {caps.rank} adapters only, "
                            f"not rank {lora.rank}: pass rank={caps.rank}", "lora_config.rank")
        for wanted, held, name in ((lora.train_attn, caps.train_attn, "train_attn"),
                                   (lora.train_mlp, caps.train_mlp, "train_mlp")):
            if wanted != held:
                raise HttpError(400, "unsupported_modules", f"this learner's adapters {'' if held else 'do not '}"
                                f"train the {name[6:]} projections: pass {name}={held}", f"lora_config.{name}")
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise HttpError(400, "unsupported_optimizer", f"optimizer {body.optimizer_config.type!r} is not "
                            "supported: adamw only", "optimizer_config.type")
        rid = str(uuid.uuid4())
        m = TinkerModel(model_id=model_id, session_id=s.session_id, tenant=tenant, key=run_key(tenant, model_id),
                        rank=lora.rank, create_request_id=rid,
                        sequencer=Sequencer(first=1, keep=settings.max_seq_ids_kept),
                        train_unembed_requested=lora.train_unembed)
        api.models[model_id] = m
        await api.runs.save_model(m, lora.seed if lora.seed is not None else _seed(model_id))
        await api.enqueue(m, rid, "json", "create", {})
        return {"request_id": rid, "model_id": model_id}

    @app.post(f"{v1}/get_info")
    async def get_info(request: Request, body: ModelRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        return {"type": "get_info", "model_id": m.model_id, "is_lora": True, "lora_rank": m.rank,
                "model_name": settings.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "llama", "model_name": settings.base_model,
                               "tokenizer_id": settings.tokenizer_id or settings.base_model}}

    # --- training -----------------------------------------------------------------------------

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        tenant = await api.tenant(request)
        body = await read_body(request, settings.max_body_bytes)
        try:
            raw = decompress(body, request.headers.get("content-encoding"), settings.max_decompressed_bytes)
        except OverflowError as e:
            raise body_too_large(settings.max_decompressed_bytes) from e
        except WireError as e:
            raise HttpError(400, "invalid_request", str(e), e.field) from e
        try:
            call = decode_forward_backward(raw)
        except WireError as e:
            raise HttpError(400, "invalid_request", str(e), e.field) from e
        m = api.model(tenant, call.model_id)
        caps = await api.caps()

        def check() -> None:
            check_call(call.loss_fn, call.data, call.loss_fn_config, caps.vocab_size, settings.max_context_length)

        return await api.sequenced(m, call.seq_id, "forward_backward", check, "forward_backward", {}, raw)

    @app.post(f"{v1}/optim_step")
    async def optim_step(request: Request, body: OptimStepRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        p = body.adam_params

        def check() -> None:
            if p is None:
                raise WireError("adam_params", "is required: this server runs AdamW only"
                                if body.optimizer_params is not None else "is required")

        return await api.sequenced(m, body.seq_id, "json", check, "optim_step",
                                   lambda: {"adam": p.model_dump(include=ADAM_FIELDS)})

    # --- weights ------------------------------------------------------------------------------

    def unused_name(m: TinkerModel, kind: str, name: str, overwrite: bool) -> None:
        try:
            exists = not overwrite and api.checkpoints.exists(m.tenant, TinkerPath(m.model_id, kind, name))
        except StorageError as e:
            raise HttpError(503, "storage_unavailable", f"path: the checkpoint store could not be read: {e}",
                            "path") from e
        if exists:
            raise HttpError(400, "checkpoint_exists", f"path: checkpoint {name!r} of {m.model_id!r} exists; "
                            "pass overwrite=True to replace it", "path")

    @app.post(f"{v1}/save_weights")
    async def save_weights(request: Request, body: SaveWeightsRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        name = body.path if body.path is not None else f"seq-{body.seq_id}-{uuid.uuid4().hex[:8]}"

        def check() -> None:
            check_name(name)
            unused_name(m, "weights", name, body.overwrite)

        return await api.sequenced(m, body.seq_id, "json", check, "save",
                                   {"kind": "weights", "name": name, "overwrite": body.overwrite})

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request, body: SaveForSamplerRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        ephemeral = body.path is None
        # The ephemeral form (`save_weights_and_get_sampling_client`) names its version itself and
        # answers a sampling session on it, which the learner records once the version is out.
        name = body.path if not ephemeral else f"ephemeral-{body.seq_id}-{uuid.uuid4().hex[:8]}"
        args: dict[str, Any] = {"kind": "sampler_weights", "name": name, "overwrite": False}

        def check() -> None:
            if ephemeral and body.sampling_session_seq_id is None:
                raise WireError("path", "is required (or sampling_session_seq_id, for the ephemeral form)")
            check_name(name)
            unused_name(m, "sampler_weights", name, overwrite=False)
            if ephemeral:
                args["sampling_session_id"] = sampling_session_id_of(m.session_id, body.sampling_session_seq_id)

        return await api.sequenced(m, body.seq_id, "json", check, "save", args)

    @app.post(f"{v1}/load_weights")
    async def load_weights(request: Request, body: LoadWeightsRequest) -> dict:
        tenant = await api.tenant(request)
        if body.session_id is not None:
            return await create_from_checkpoint(tenant, body)
        if body.model_id is None or body.seq_id is None:
            raise HttpError(400, "invalid_request", "load_weights takes {model_id, seq_id} or {session_id, "
                            "model_seq_id}", "model_id")
        m = api.model(tenant, body.model_id)

        def check() -> None:
            _, info = api.checkpoint(tenant, body.path)
            check_loadable(info, body.optimizer, m.rank)

        return await api.sequenced(m, body.seq_id, "json", check, "load",
                                   lambda: {"optimizer": body.optimizer, "path": body.path})

    def check_loadable(info: CheckpointInfo, optimizer: bool, rank: int) -> None:
        if info.lora_rank != rank or info.base_model != settings.base_model:
            raise HttpError(400, "incompatible_checkpoint", f"path: the checkpoint is a rank {info.lora_rank} "
                            f"adapter of {info.base_model!r}; this model is rank {rank} on {settings.base_model!r}",
                            "path")
        if optimizer and not info.has_optimizer:
            raise HttpError(400, "no_optimizer_state", "optimizer: the checkpoint holds no optimizer state",
                            "optimizer")

    async def create_from_checkpoint(tenant: str, body: LoadWeightsRequest) -> dict:
        """Form A: a new model `{session_id}:train:{model_seq_id}` from the checkpoint; the load
        is its seq 0, so its first training request is seq 1."""
        s = api.session(tenant, body.session_id)
        if body.model_seq_id is None:
            raise HttpError(400, "invalid_request", "model_seq_id is required with session_id", "model_seq_id")
        model_id = model_id_of(s.session_id, body.model_seq_id)
        existing = api.models.get(model_id)
        if existing is not None:   # a retried POST
            return {"request_id": existing.create_request_id, "model_id": model_id}
        if body.base_model is not None and body.base_model != settings.base_model:
            raise HttpError(400, "unsupported_model", f"base_model {body.base_model!r} is not served here",
                            "base_model")
        _, info = api.checkpoint(tenant, body.path)
        check_loadable(info, body.optimizer, (await api.caps()).rank)
        rid = str(uuid.uuid4())
        m = TinkerModel(model_id=model_id, session_id=s.session_id, tenant=tenant, key=run_key(tenant, model_id),
                        rank=info.lora_rank, create_request_id=rid,
                        sequencer=Sequencer(first=1, keep=settings.max_seq_ids_kept))
        api.models[model_id] = m
        await api.runs.save_model(m, _seed(model_id))
        await api.enqueue(m, str(uuid.uuid4()), "json", "create", {})
        await api.enqueue(m, rid, "json", "load", {"optimizer": body.optimizer, "path": body.path, "creates": True})
        return {"request_id": rid, "model_id": model_id}

    @app.post(f"{v1}/weights_info")
    async def weights_info(request: Request, body: WeightsInfoRequest) -> dict:
        _, info = api.checkpoint(await api.tenant(request), body.tinker_path, KINDS_ALL, "tinker_path")
        return {"base_model": info.base_model, "is_lora": True, "lora_rank": info.lora_rank,
                "train_unembed": False, "train_mlp": info.train_mlp, "train_attn": info.train_attn,
                "optimizer_config": {"type": "adamw"}}

    install_sampling(app, api)

    # --- futures ------------------------------------------------------------------------------

    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request, body: RetrieveRequest) -> Response:
        tenant = await api.tenant(request)
        with api.finished.watch(body.request_id) as woken:   # before the first read: no wake-up missed
            o = await queue.outcome(api.redis, body.request_id)
            if o is None:
                raise HttpError(410, "request_expired", f"request {body.request_id!r} is unknown or expired",
                                "request_id")
            if o.tenant != tenant:
                raise HttpError(404, "request_not_found", f"no request {body.request_id!r}", "request_id")
            deadline = time.monotonic() + settings.retrieve_hold_s
            while o is not None and o.state == "pending" and (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(left, settings.retrieve_poll_s))
                woken.clear()
                o = await queue.outcome(api.redis, body.request_id)
        if o is None:
            raise HttpError(410, "request_expired", f"request {body.request_id!r} expired", "request_id")
        if o.state == "pending":
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"},
                                status_code=408)
        return api.render(o, request.headers.get("accept", ""))

    return app

"""The Tinker-compatible HTTP door: the routes the official `tinker` SDK 0.38 calls, under `/api/v1`.

    create_app(settings, authenticate, backend) -> FastAPI

`authenticate` maps an `X-API-Key` to its tenant (`Registry.authenticate_tinker`: only `tml-`
keys; tenant keys and admin tokens never open this door). Every error is a non-empty JSON body
in clora's shape naming the field (`clora.web.HttpError`): the SDK treats an empty 400 as a
network fault and retries it. No logic error is 409, which the SDK retries too.

Routes (docs/tinker-protocol.md §4, §11): the handshake (`client/config`, `client/dynamic_config`,
`telemetry`), sessions (`create_session`, `session_heartbeat`, `sessions/{id}/finish`,
`get_server_capabilities`, `healthz`), models (`create_model`, `get_info`), training
(`forward_backward`, `optim_step`) and `retrieve_future`. Training requests are checked, put in
their model's `seq_id` order (`Sequencer`) and run one at a time on a single worker thread in
the order accepted; their results are fetched with `retrieve_future`.

Weights (`trainapi.weights`): `save_weights` (adapter + Adam state, resumable),
`save_weights_for_sampler` in its named form (a PEFT adapter folder), `load_weights` (in the
model's order, or creating the model from a checkpoint) and `weights_info`. Every checkpoint path
resolves under the asking tenant's own folder. Sampling, and the ephemeral
`save_weights_for_sampler` that feeds it, are the next phase.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from pathlib import Path
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from clora.registry import ApiKeyPrincipal
from clora.trainapi.backend import AdamParams, TrainingBackend, run_key
from clora.trainapi.futures import Future, FutureStore
from clora.trainapi.losses import check_call
from clora.trainapi.runs import Session, TinkerModel, model_id_of
from clora.trainapi.sequencer import Sequencer, SeqError
from clora.trainapi.settings import TrainApiSettings
from clora.trainapi.weights import KINDS as KINDS_ALL, CheckpointDir, CheckpointInfo, NotFound, TinkerPath, \
    check_name, parse_path
from clora.trainapi.wire import WireError, decode_forward_backward, decompress, forward_backward_json, \
    forward_backward_output
from clora.web import HttpError, body_too_large, install_error_handlers, read_body

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
    seed: int | None = None
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
    request_id: str
    allow_metadata_only: bool = False


class TrainApi:
    """The service's state: sessions, models, futures and the worker the backend runs on."""

    def __init__(self, settings: TrainApiSettings, authenticate: Authenticate, backend: TrainingBackend):
        self.settings, self.authenticate, self.backend = settings, authenticate, backend
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TinkerModel] = {}
        self.futures = FutureStore(settings.future_ttl_s, settings.max_futures)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainapi-worker")
        self.checkpoints = CheckpointDir(settings.checkpoints_dir)

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

    def checkpoint(self, tenant: str, path: str, kinds: tuple[str, ...] = ("weights",),
                   field: str = "path") -> tuple[TinkerPath, Path, CheckpointInfo]:
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
            folder, info = self.checkpoints.find(tenant, p, field)
        except NotFound as e:
            raise HttpError(404, "checkpoint_not_found", str(e), field) from e
        return p, folder, info

    # --- running requests -------------------------------------------------------------------

    def submit(self, f: Future, job: Callable[[], Any]) -> None:
        """Run `job` on the worker after everything submitted before it; its result or error
        finishes `f`."""
        done = asyncio.get_running_loop().run_in_executor(self.worker, job)

        def finish(task: asyncio.Future) -> None:
            e = task.exception()
            if e is None:
                self.futures.complete(f.request_id, task.result())
            elif isinstance(e, (WireError, ValueError, FloatingPointError, FileExistsError)):
                self.futures.fail(f.request_id, str(e), "user")
            else:
                log.error("training request %s of %s failed", f.request_id, f.model_id, exc_info=e)
                self.futures.fail(f.request_id, f"{type(e).__name__}: {e}", "server")

        done.add_done_callback(finish)

    def sequenced(self, m: TinkerModel, seq_id: int, kind: Literal["json", "forward_backward"],
                  check: Callable[[], None], job: Callable[[], Any]) -> dict:
        """The future of request `seq_id` of model `m`: a retry's own again; else, once `check`
        passes, a new one running `job` in order. `check`'s refusal uses up the seq_id."""
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
            m.sequencer.refuse(seq_id, 400, e.field, str(e))
            raise HttpError(400, "invalid_request", str(e), e.field) from e
        except HttpError as e:
            m.sequencer.refuse(seq_id, e.status, e.field, e.message)
            raise
        f = self.futures.create(m.tenant, m.model_id, kind)
        m.sequencer.accept(seq_id, f.request_id)
        self.submit(f, job)
        return {"request_id": f.request_id, "model_id": m.model_id}

    def render(self, f: Future, accept: str) -> Response:
        if f.state == "failed":
            return JSONResponse({"error": f.error, "category": f.category})
        if f.kind == "forward_backward":
            if PROTOBUF in accept:
                return Response(forward_backward_output(f.result), media_type=PROTOBUF)
            return JSONResponse(forward_backward_json(f.result))
        return JSONResponse(f.result)


def _seed(model_id: str) -> int:
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little")


def create_app(settings: TrainApiSettings, authenticate: Authenticate, backend: TrainingBackend) -> FastAPI:
    api = TrainApi(settings, authenticate, backend)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        api.worker.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(title="clora Tinker-compatible training API", lifespan=lifespan)
    app.state.trainapi = api
    install_error_handlers(app, "clora")

    async def not_found(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else "http_error"
        return HttpError(e.status_code, code, str(e.detail), "path").response("clora")

    app.add_exception_handler(StarletteHTTPException, not_found)
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
                                      "trainable": True, "sampleable": False}]}

    # --- sessions -----------------------------------------------------------------------------

    @app.post(f"{v1}/create_session")
    async def create_session(request: Request, body: CreateSessionRequest) -> dict:
        tenant = await api.tenant(request)
        s = Session(session_id=str(uuid.uuid4()), tenant=tenant, sdk_version=body.sdk_version)
        api.sessions[s.session_id] = s
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
        s.last_heartbeat = time.time()
        return {"type": "session_heartbeat"}

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(request: Request, session_id: str, body: FinishRequest) -> dict:
        s = api.session(await api.tenant(request), session_id)
        s.finished = str((body.reason or {}).get("type", "success"))
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
        caps, lora = backend.capabilities(), body.lora_config
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
        f = api.futures.create(tenant, model_id, "json")
        api.models[model_id] = TinkerModel(model_id=model_id, session_id=s.session_id, tenant=tenant,
                                           key=run_key(tenant, model_id), rank=lora.rank,
                                           create_request_id=f.request_id,
                                           sequencer=Sequencer(first=1, keep=settings.max_seq_ids_kept),
                                           train_unembed_requested=lora.train_unembed)
        seed = lora.seed if lora.seed is not None else _seed(model_id)
        key = api.models[model_id].key

        def job() -> dict:
            backend.create(key, seed)
            return {"type": "create_model", "model_id": model_id}

        api.submit(f, job)
        return {"request_id": f.request_id, "model_id": model_id}

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
        caps = backend.capabilities()

        def check() -> None:
            check_call(call.loss_fn, call.data, call.loss_fn_config, caps.vocab_size, settings.max_context_length)

        def job():
            return backend.forward_backward(m.key, call.data, call.loss_fn, call.loss_fn_config, call.forward_only)

        return api.sequenced(m, call.seq_id, "forward_backward", check, job)

    @app.post(f"{v1}/optim_step")
    async def optim_step(request: Request, body: OptimStepRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        p = body.adam_params

        def check() -> None:
            if p is None:
                raise WireError("adam_params", "is required: this server runs AdamW only"
                                if body.optimizer_params is not None else "is required")

        def job() -> dict:
            metrics = backend.optim_step(m.key, AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps,
                                                           p.weight_decay, p.grad_clip_norm))
            return {"type": "optim_step", "metrics": metrics}

        return api.sequenced(m, body.seq_id, "json", check, job)

    # --- weights ------------------------------------------------------------------------------

    def save(m: TinkerModel, kind: str, name: str, overwrite: bool, optimizer: bool) -> dict:
        """The job writing `m`'s checkpoint `name` of `kind` atomically; its path."""
        p = TinkerPath(m.model_id, kind, name)
        caps = backend.capabilities()

        def fill(folder: Path) -> CheckpointInfo:
            step = backend.save_state(m.key, folder, settings.base_model, optimizer)
            return CheckpointInfo(path=str(p), tenant=m.tenant, base_model=settings.base_model, lora_rank=m.rank,
                                  train_attn=caps.train_attn, train_mlp=caps.train_mlp, step=step,
                                  has_optimizer=optimizer, created_at=time.time())

        api.checkpoints.write(m.tenant, p, overwrite, fill)
        return {"type": "save_weights" if kind == "weights" else "save_weights_for_sampler", "path": str(p)}

    def unused_name(m: TinkerModel, kind: str, name: str, overwrite: bool) -> None:
        if not overwrite and api.checkpoints.folder(m.tenant, TinkerPath(m.model_id, kind, name)).exists():
            raise HttpError(400, "checkpoint_exists", f"path: checkpoint {name!r} of {m.model_id!r} exists; "
                            "pass overwrite=True to replace it", "path")

    @app.post(f"{v1}/save_weights")
    async def save_weights(request: Request, body: SaveWeightsRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        name = body.path if body.path is not None else f"seq-{body.seq_id}-{uuid.uuid4().hex[:8]}"

        def check() -> None:
            check_name(name)
            unused_name(m, "weights", name, body.overwrite)

        return api.sequenced(m, body.seq_id, "json", check,
                             lambda: save(m, "weights", name, body.overwrite, optimizer=True))

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request, body: SaveForSamplerRequest) -> dict:
        m = api.model(await api.tenant(request), body.model_id)
        name = body.path

        def check() -> None:
            if name is None:
                raise WireError("path", "is required: the ephemeral form (save_weights_and_get_sampling_client) "
                                        "needs sampling, which this server does not serve yet")
            check_name(name)
            unused_name(m, "sampler_weights", name, overwrite=False)

        # TODO(issue 19, next phase): publish the folder as `tenant@vN` through the learner's
        # `Publisher` (registry record + AdapterEvent), which needs the cross-process backend.
        return api.sequenced(m, body.seq_id, "json", check,
                             lambda: save(m, "sampler_weights", name, False, optimizer=False))

    @app.post(f"{v1}/load_weights")
    async def load_weights(request: Request, body: LoadWeightsRequest) -> dict:
        tenant = await api.tenant(request)
        if body.session_id is not None:
            return create_from_checkpoint(tenant, body)
        if body.model_id is None or body.seq_id is None:
            raise HttpError(400, "invalid_request", "load_weights takes {model_id, seq_id} or {session_id, "
                            "model_seq_id}", "model_id")
        m = api.model(tenant, body.model_id)
        found: list[Path] = []

        def check() -> None:
            _, folder, info = api.checkpoint(tenant, body.path)
            check_loadable(info, body.optimizer, m.rank)
            found.append(folder)

        def job() -> dict:
            backend.load_state(m.key, found[0], body.optimizer)
            return {"type": "load_weights", "path": body.path}

        return api.sequenced(m, body.seq_id, "json", check, job)

    def check_loadable(info: CheckpointInfo, optimizer: bool, rank: int) -> None:
        if info.lora_rank != rank or info.base_model != settings.base_model:
            raise HttpError(400, "incompatible_checkpoint", f"path: the checkpoint is a rank {info.lora_rank} "
                            f"adapter of {info.base_model!r}; this model is rank {rank} on {settings.base_model!r}",
                            "path")
        if optimizer and not info.has_optimizer:
            raise HttpError(400, "no_optimizer_state", "optimizer: the checkpoint holds no optimizer state",
                            "optimizer")

    def create_from_checkpoint(tenant: str, body: LoadWeightsRequest) -> dict:
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
        _, folder, info = api.checkpoint(tenant, body.path)
        check_loadable(info, body.optimizer, backend.capabilities().rank)
        f = api.futures.create(tenant, model_id, "json")
        m = TinkerModel(model_id=model_id, session_id=s.session_id, tenant=tenant, key=run_key(tenant, model_id),
                        rank=info.lora_rank, create_request_id=f.request_id,
                        sequencer=Sequencer(first=1, keep=settings.max_seq_ids_kept))
        api.models[model_id] = m

        def job() -> dict:
            backend.create(m.key, _seed(model_id))
            backend.load_state(m.key, folder, body.optimizer)
            return {"type": "load_weights", "path": body.path, "model_id": model_id}

        api.submit(f, job)
        return {"request_id": f.request_id, "model_id": model_id}

    @app.post(f"{v1}/weights_info")
    async def weights_info(request: Request, body: WeightsInfoRequest) -> dict:
        _, _, info = api.checkpoint(await api.tenant(request), body.tinker_path, KINDS_ALL, "tinker_path")
        return {"base_model": info.base_model, "is_lora": True, "lora_rank": info.lora_rank,
                "train_unembed": False, "train_mlp": info.train_mlp, "train_attn": info.train_attn,
                "optimizer_config": {"type": "adamw"}}

    # --- futures ------------------------------------------------------------------------------

    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request, body: RetrieveRequest) -> Response:
        tenant = await api.tenant(request)
        f = api.futures.get(body.request_id)
        if f is None:
            raise HttpError(410, "request_expired", f"request {body.request_id!r} is unknown or expired",
                            "request_id")
        if f.tenant != tenant:
            raise HttpError(404, "request_not_found", f"no request {body.request_id!r}", "request_id")
        f = await api.futures.wait(f, settings.retrieve_hold_s)
        if f.state == "pending":
            return JSONResponse({"type": "try_again", "request_id": f.request_id, "queue_state": "active"},
                                status_code=408)
        return api.render(f, request.headers.get("accept", ""))

    return app

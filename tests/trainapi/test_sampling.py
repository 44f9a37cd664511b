"""Sampling through the training API (`clora.trainapi.sampling`): sampling sessions of a saved
path, of the base model or of an ephemeral save; `asample` answered at once with one sequence id
per sample and run on the gateway with the caller's own key; results that the SDK's own decoder
reads; resent requests sampled once; bad input a 4xx naming the field, with nothing sampled.

The routes sit on a minimal app around a stand-in for the app's `TrainApi`, and sample through the
real gateway (`tests/serving/tinker_harness.py`: in process, on a fake vLLM); the SDK test serves
that app with the few handshake routes the SDK needs before it samples."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clora.registry import AdapterVersion, Registry
from clora.trainapi import queue
from clora.trainapi.sampling import (SamplingSession, aget_sampling_session, aput_sampling_session,
                                     get_sampling_session, install_sampling, put_sampling_session,
                                     sampling_session_id_of)
from clora.trainapi.settings import TrainApiSettings
from clora.web import HttpError, install_error_handlers
from tests.serving.tinker_harness import prompt_logprob, sampled, tinker_harness

KEYS = {"tml-acme": "acme", "tml-beta": "beta"}
PATH = "tinker://s1:train:0/sampler_weights/final"
"""acme's saved sampler weights, published as acme@v7 (the gateway harness knows the same)."""
PROTOBUF = "application/x-protobuf"


class FakeRedis:
    """The few Redis commands sampling, its futures (`clora.trainapi.queue`) and the registry's
    sampler map use, in memory: plain calls as `redis.Redis`, and as `redis.asyncio.Redis`
    through `aio`. Expiry is recorded, not enforced."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.hashes: dict[str, dict[str, bytes]] = {}
        self.sets: dict[str, set[bytes]] = {}
        self.ttl: dict[str, int] = {}

    def get(self, key):
        return self.values.get(key)

    def set(self, key, value, nx=False, ex=None):
        if nx and key in self.values:
            return None
        self.values[key] = value.encode() if isinstance(value, str) else value
        self.ttl[key] = ex
        return True

    def expire(self, key, seconds):
        self.ttl[key] = seconds
        return key in self.values

    def hget(self, name, key):
        return self.hashes.get(name, {}).get(key)

    def hset(self, name, key=None, value=None, mapping=None):
        fields = ({key: value} if key is not None else {}) | (mapping or {})
        for k, v in fields.items():
            self.hashes.setdefault(name, {})[k] = v if isinstance(v, bytes) else str(v).encode()
        return len(fields)

    def hmget(self, name, keys):
        return [self.hashes.get(name, {}).get(k) for k in keys]

    def sadd(self, name, *members):
        new = {m.encode() if isinstance(m, str) else m for m in members} - self.sets.setdefault(name, set())
        self.sets[name] |= new
        return len(new)

    def sismember(self, name, member):
        return int((member.encode() if isinstance(member, str) else member) in self.sets.get(name, set()))

    def hsetnx(self, name, key, value):
        if key in self.hashes.get(name, {}):
            return 0
        self.hashes.setdefault(name, {})[key] = value.encode() if isinstance(value, str) else value
        return 1

    @property
    def aio(self) -> Any:
        sync = self

        class Pipeline:
            def __init__(self):
                self.calls = []

            def __getattr__(self, name):
                return lambda *args, **kw: self.calls.append((name, args, kw))

            async def execute(self):
                return [getattr(sync, name)(*args, **kw) for name, args, kw in self.calls]

            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

        class Async:
            def pipeline(self, transaction=True):
                return Pipeline()

            def __getattr__(self, name):
                method = getattr(sync, name)

                async def call(*args, **kw):
                    return method(*args, **kw)
                return call
        return Async()


async def finished(r, rid: str, timeout_s: float = 10.0) -> queue.Outcome:
    """Request `rid`'s outcome once it is no longer pending."""
    deadline = time.monotonic() + timeout_s
    while (o := await queue.outcome(r, rid)) is None or o.state == "pending":
        assert time.monotonic() < deadline, f"request {rid} still {o.state if o else 'unknown'}"
        await asyncio.sleep(0.01)
    return o


@dataclass
class StandInApi:
    """What `install_sampling` uses of the app's `TrainApi`."""

    settings: TrainApiSettings
    redis: Any
    sessions: dict[str, str] = field(default_factory=lambda: {"s1": "acme", "s2": "beta"})
    """session id -> its tenant."""

    async def tenant(self, request: Request) -> str:
        tenant = KEYS.get(request.headers.get("x-api-key", ""))
        if tenant is None:
            raise HttpError(401, "unauthorized", "a valid Tinker key (tml-...) is required in X-API-Key", "X-API-Key")
        return tenant

    def session(self, tenant: str, session_id: str):
        if self.sessions.get(session_id) != tenant:
            raise HttpError(404, "session_not_found", f"no session {session_id!r}", "session_id")
        return SimpleNamespace(session_id=session_id)


class World:
    """A sampling app, its stand-in `TrainApi`, and the gateway it samples on."""

    def __init__(self, tmp_path, wrap=lambda transport: transport, **settings: Any):
        """`wrap`: puts a transport of the test's between the API and the gateway."""
        self.harness = tinker_harness(tmp_path)
        self.redis = FakeRedis()
        registry = Registry(self.redis)
        self.redis.sadd("clora:tenants", "acme")         # acme is a tenant in service
        registry.record_adapter_version("acme", AdapterVersion(version=7, path="/a/acme/v7", base_model="tiny",
                                                               source="tinker", tinker_path=PATH))
        registry.record_tinker_sampler("acme", PATH, 7)
        s = TrainApiSettings(base_model="tiny", gateway_url="http://gateway", **settings)
        self.api = StandInApi(s, self.redis.aio)
        self.transport = wrap(httpx.ASGITransport(app=self.harness.app))
        self.gateway = httpx.AsyncClient(transport=self.transport)
        self.app = FastAPI()
        install_error_handlers(self.app, "clora")
        install_sampling(self.app, self.api, gateway=self.gateway)

    def client(self, key: str = "tml-acme") -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://trainapi",
                                 headers={"x-api-key": key})

    def upstream(self) -> list[dict]:
        return [body for path, body, _ in self.harness.upstream if path == "/v1/completions"]


@pytest.fixture
def world(tmp_path):
    made: list[World] = []

    def make(**kw) -> World:
        w = World(tmp_path / f"w{len(made)}", **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.harness.close()


def asample_body(sid: str, seq_id: int = 0, prompt: list[int] = (1, 42, 7, 9), **kw) -> dict:
    body = {"sampling_session_id": sid, "seq_id": seq_id, "num_samples": 1, "type": "sample",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
            "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0,
            "prompt_alt_tokens_k": 0, "record_stability_info": False}
    return {**body, **kw}


async def new_session(c: httpx.AsyncClient, **target: Any) -> str:
    r = await c.post("/api/v1/create_sampling_session", json={"session_id": "s1", "sampling_session_seq_id": 0,
                                                               "type": "create_sampling_session", **target})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def decoded(o: queue.Outcome):
    """A finished sample's result as the SDK 0.38 reads it off the wire."""
    from tinker.proto.response_conv import deserialize_sample_response

    assert (o.state, o.kind) == ("done", "sample"), o
    return deserialize_sample_response(o.result)


# --- sampling sessions -------------------------------------------------------------------------

def test_a_session_of_a_saved_path_serves_the_version_it_was_published_as(world):
    w = world()

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            assert sid == "s1:sample:0" == sampling_session_id_of("s1", 0)
            assert await aget_sampling_session(w.api.redis, sid) == SamplingSession("acme", "acme@v7", PATH)
            assert (await c.get(f"/api/v1/samplers/{sid}")).json() == \
                {"sampler_id": sid, "base_model": "tiny", "model_path": PATH}
            assert await new_session(c, model_path=PATH) == sid                   # a retried create
            base = (await c.post("/api/v1/create_sampling_session", json={
                "session_id": "s1", "sampling_session_seq_id": 1, "base_model": "tiny"})).json()["sampling_session_id"]
            assert await aget_sampling_session(w.api.redis, base) == SamplingSession("acme", "base")
            async with w.client("tml-beta") as other:                             # acme's, asked by beta
                assert (await other.get(f"/api/v1/samplers/{sid}")).status_code == 404
    asyncio.run(go())


def test_an_ephemeral_session_the_learner_records_is_served_here(world):
    w = world()
    sid = sampling_session_id_of("s1", 4)
    put_sampling_session(w.redis, sid, "acme", "acme@v9")        # the executor, on the learner's side
    assert get_sampling_session(w.redis, sid) == SamplingSession("acme", "acme@v9")
    assert get_sampling_session(w.redis, "s1:sample:5") is None

    async def go():
        async with w.client() as c:
            r = await c.post("/api/v1/asample", json=asample_body(sid))
            assert r.status_code == 200, r.text
            assert (await finished(w.api.redis, r.json()["request_id"])).state == "done"
            assert (await c.get(f"/api/v1/samplers/{sid}")).json()["model_path"] is None
    asyncio.run(go())
    assert w.upstream()[0]["model"] == "acme@v9"


@pytest.mark.parametrize("target, status, field", [
    ({"model_path": "tinker://s1:train:0/sampler_weights/never"}, 404, "model_path"),
    ({"model_path": "tinker://s1:train:0/weights/final"}, 400, "model_path"),       # training state, not sampler
    ({"model_path": "s1/sampler_weights/final"}, 400, "model_path"),
    ({"model_path": "tinker://s1:train:0/sampler_weights/a/b"}, 400, "model_path"),
    ({"base_model": "Qwen/Qwen3-8B"}, 400, "base_model"),
    ({}, 400, "model_path"),
])
def test_a_session_of_what_this_tenant_cannot_sample_is_refused_naming_the_field(world, target, status, field):
    w = world()

    async def go():
        async with w.client() as c:
            r = await c.post("/api/v1/create_sampling_session",
                             json={"session_id": "s1", "sampling_session_seq_id": 0, **target})
            assert r.status_code == status and r.json()["error"]["field"] == field, r.text
    asyncio.run(go())
    assert w.redis.values == {}


def test_another_tenants_saved_path_or_session_is_not_found(world):
    w = world()

    async def go():
        async with w.client("tml-beta") as c:
            r = await c.post("/api/v1/create_sampling_session",
                             json={"session_id": "s2", "sampling_session_seq_id": 0, "model_path": PATH})
            assert r.status_code == 404 and r.json()["error"]["field"] == "model_path"
            r = await c.post("/api/v1/create_sampling_session",
                             json={"session_id": "s1", "sampling_session_seq_id": 0, "base_model": "tiny"})
            assert r.status_code == 404 and r.json()["error"]["field"] == "session_id"
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
        async with w.client("tml-beta") as c:
            r = await c.post("/api/v1/asample", json=asample_body(sid))
            assert r.status_code == 404 and r.json()["error"]["field"] == "sampling_session_id"
    asyncio.run(go())
    assert w.upstream() == []


# --- asample -------------------------------------------------------------------------------

def test_asample_answers_one_id_per_sample_and_its_result_decodes_in_the_sdk(world):
    w = world()
    prompt = [1, 42, 7, 9, 11]
    stop = sampled(prompt, 1, 6)[1]                 # sample 1 stops at its second token

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            body = asample_body(sid, prompt=(), num_samples=2, prompt_logprobs=True,
                                sampling_params={"max_tokens": 6, "temperature": 0.8, "top_k": 5, "top_p": 0.9,
                                                 "seed": 3, "stop": [stop]})
            body["prompt"]["chunks"] = [{"type": "encoded_text", "tokens": prompt[:2]},
                                        {"type": "encoded_text", "tokens": prompt[2:]}]   # concatenated
            r = await c.post("/api/v1/asample", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            ids = answer["sample_sequence_ids"]
            assert len(ids) == 2 == len(set(ids)) and all(i.startswith(answer["request_id"]) for i in ids)
            return await finished(w.api.redis, answer["request_id"])
    o = asyncio.run(go())
    (up,) = w.upstream()
    assert (up["model"], up["prompt"], up["n"], up["max_tokens"], up["stop_token_ids"], up["seed"], up["top_k"]) == \
        ("acme@v7", prompt, 2, 6, [stop], 3, 5)
    out = decoded(o)
    assert [s.tokens for s in out.sequences] == [sampled(prompt, 0, 6), sampled(prompt, 1, 6)[:2]]
    assert [s.stop_reason for s in out.sequences] == ["length", "stop"]
    assert out.sequences[1].logprobs == pytest.approx([-0.5, -0.51])
    assert out.prompt_logprobs == [None] + [pytest.approx(prompt_logprob(k)) for k in range(1, 5)]
    plain = o.result_json                                                        # for SDKs before 0.25
    assert plain["type"] == "sample" and plain["prompt_logprobs"][0] is None
    assert plain["sequences"][1] == {"tokens": sampled(prompt, 1, 6)[:2], "logprobs": pytest.approx([-0.5, -0.51]),
                                     "stop_reason": "stop"}


def test_a_resent_asample_gets_its_first_request_back_and_is_sampled_once(world):
    w = world()

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            first = (await c.post("/api/v1/asample", json=asample_body(sid, seq_id=4))).json()
            again = (await c.post("/api/v1/asample", json=asample_body(sid, seq_id=4))).json()
            other = (await c.post("/api/v1/asample", json=asample_body(sid, seq_id=5))).json()
            assert again == first and other["request_id"] != first["request_id"]
            await finished(w.api.redis, first["request_id"])
            await finished(w.api.redis, other["request_id"])
    asyncio.run(go())
    assert len(w.upstream()) == 2


def test_prompt_logprobs_last_n_scores_only_the_suffix(world):
    w = world()

    async def go():
        async with w.client() as c:
            sid = await new_session(c, base_model="tiny")
            r = await c.post("/api/v1/asample", json=asample_body(sid, prompt=(5, 6, 7, 8, 9), prompt_logprobs=True,
                                                                  prompt_logprobs_last_n=2))
            return await finished(w.api.redis, r.json()["request_id"])
    assert decoded(asyncio.run(go())).prompt_logprobs == [None, None, None, pytest.approx(prompt_logprob(3)),
                                               pytest.approx(prompt_logprob(4))]
    assert w.upstream()[0]["model"] == "base"


@pytest.mark.parametrize("change, status, field", [
    ({"sampling_session_id": "s1:sample:99"}, 404, "sampling_session_id"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]},
                            {"type": "image", "data": "", "format": "png"}]}}, 400, "prompt.chunks.1"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, -3]}]}}, 400, "prompt.chunks.0.tokens"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": []}]}}, 400, "prompt"),
    ({"topk_prompt_logprobs": 3}, 400, "topk_prompt_logprobs"),
    ({"topk_sample_logprobs": 3}, 400, "topk_sample_logprobs"),
    ({"prompt_alt_tokens_k": 2}, 400, "prompt_alt_tokens_k"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, 1]}}, 400, "target_prompt_logprobs"),
    ({"record_stability_info": True}, 400, "record_stability_info"),
    ({"prompt_logprobs_last_n": 1}, 400, "prompt_logprobs_last_n"),                    # without prompt_logprobs
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, 400, "prompt_logprobs_last_n"),   # a 4-token prompt
    ({"num_samples": 0}, 422, "num_samples"),
    ({"sampling_params": {"stop": ["a", 2]}}, 422, "sampling_params.stop"),
    ({"sampling_params": {"temperature": -1}}, 422, "sampling_params.temperature"),
    ({"sampling_params": {"max_tokens": 0}}, 422, "sampling_params.max_tokens"),
    ({"prompt": "hello"}, 422, "prompt"),
    ({"sampling_session_id": None, "base_model": "other"}, 400, "base_model"),
    ({"sampling_session_id": None, "model_path": "tinker://s1:train:0/weights/x"}, 400, "model_path"),
])
def test_bad_asample_input_is_a_4xx_naming_the_field_and_samples_nothing(world, change, status, field):
    w = world()

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            r = await c.post("/api/v1/asample", json={**asample_body(sid), **change})
            assert r.status_code == status and r.json()["error"]["field"] == field, r.text
    asyncio.run(go())
    assert w.upstream() == [] and not any(k.startswith("clora:tinker:req:") for k in w.redis.hashes)


def test_the_legacy_form_samples_a_path_without_a_session(world):
    w = world()

    async def go():
        async with w.client() as c:
            r = await c.post("/api/v1/asample", json=asample_body(None, model_path=PATH))
            return await finished(w.api.redis, r.json()["request_id"])
    assert asyncio.run(go()).state == "done" and w.upstream()[0]["model"] == "acme@v7"


def test_a_sample_the_gateway_refuses_fails_its_future_as_the_users_with_the_reason(world):
    w = world()

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            r = await c.post("/api/v1/asample", json=asample_body(sid, num_samples=40))   # the tenant's n is 16
            return await finished(w.api.redis, r.json()["request_id"])
    o = asyncio.run(go())
    assert (o.state, o.category) == ("failed", "user") and "num_samples" in o.error and "16" in o.error


class Flaky(httpx.AsyncBaseTransport):
    """Answers `first` (a status) `times` times, then passes requests on to `then`."""

    def __init__(self, then: httpx.AsyncBaseTransport, first: int, times: int):
        self.then, self.first, self.times, self.calls = then, first, times, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.times:
            return httpx.Response(self.first, headers={"retry-after": "0"},
                                  json={"error": {"message": "busy", "type": "requests"}})
        return await self.then.handle_async_request(request)


@pytest.mark.parametrize("status", [429, 503])
def test_the_gateways_429_and_503_are_waited_out(world, status):
    w = world(wrap=lambda t: Flaky(t, status, times=2))
    flaky = w.transport

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            r = await c.post("/api/v1/asample", json=asample_body(sid))
            return await finished(w.api.redis, r.json()["request_id"])
    assert asyncio.run(go()).state == "done" and flaky.calls == 3


def test_a_sample_the_gateway_never_takes_fails_as_the_servers_once_its_time_is_up(world):
    w = world(sample_timeout_s=0.5, wrap=lambda t: Flaky(t, 503, times=10**6))

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            started = time.monotonic()
            r = await c.post("/api/v1/asample", json=asample_body(sid))
            outcome = await finished(w.api.redis, r.json()["request_id"])
            return outcome, time.monotonic() - started
    o, took = asyncio.run(go())
    assert (o.state, o.category) == ("failed", "server") and "busy" in o.error and took < 5


class Held(httpx.AsyncBaseTransport):
    """Holds every request until `release` is set."""

    def __init__(self, then: httpx.AsyncBaseTransport):
        self.then, self.release = then, asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self.release.wait()
        return await self.then.handle_async_request(request)


def test_more_samples_in_flight_than_a_tenant_may_have_is_a_429_the_sdk_waits_out(world):
    w = world(max_samples_in_flight=1, wrap=Held)
    held = w.transport

    async def go():
        async with w.client() as c:
            sid = await new_session(c, model_path=PATH)
            first = (await c.post("/api/v1/asample", json=asample_body(sid, seq_id=0))).json()
            r = await c.post("/api/v1/asample", json=asample_body(sid, seq_id=1))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert (await c.post("/api/v1/asample", json=asample_body(sid, seq_id=0))).json() == first   # a resend
            held.release.set()
            assert (await finished(w.api.redis, first["request_id"])).state == "done"
            r = await c.post("/api/v1/asample", json=asample_body(sid, seq_id=1))   # the SDK's resend
            assert r.status_code == 200
            await finished(w.api.redis, r.json()["request_id"])
    asyncio.run(go())


# --- the SDK ---------------------------------------------------------------------------------

def sdk_app(w: World) -> FastAPI:
    """The sampling routes plus what the SDK calls before and around them (the real app's
    handshake, sessions and `retrieve_future`, reduced to what sampling needs)."""
    app, api = w.app, w.api

    @app.post("/api/v1/client/config")
    async def config() -> dict:
        return {"use_pyqwest_transport": False, "pjwt_auth_enabled": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        sid = str(uuid.uuid4())
        api.sessions[sid] = await api.tenant(request)
        return {"session_id": sid}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict:
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Response:
        rid = (await request.json())["request_id"]
        try:
            o = await finished(api.redis, rid, timeout_s=2)
        except AssertionError:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408)
        if o.state == "failed":
            return JSONResponse({"error": o.error, "category": o.category})
        if PROTOBUF in request.headers.get("accept", ""):
            return Response(o.result, media_type=PROTOBUF)
        return JSONResponse(o.result_json)

    return app


def test_the_sdk_samples_a_saved_path_and_scores_a_prompt(world, monkeypatch):
    tinker = pytest.importorskip("tinker")
    from tests.fakes import ServerThread

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    w = world()
    prompt = [1, 42, 7, 9]
    with ServerThread(sdk_app(w), lifespan="auto") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key="tml-acme")
        sampler = client.create_sampling_client(model_path=PATH).result()
        assert sampler.get_base_model() == "tiny"                            # from GET samplers/{id}
        stop = sampled(prompt, 2, 5)[3]
        out = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=3,
                             sampling_params=tinker.SamplingParams(max_tokens=5, stop=[stop])).result()
        assert [s.tokens for s in out.sequences][2] == sampled(prompt, 2, 5)[:4]
        assert out.sequences[2].stop_reason == "stop" and out.sequences[0].stop_reason == "length"
        assert all(len(s.logprobs) == len(s.tokens) for s in out.sequences)
        assert len({s.sequence_id for s in out.sequences}) == 3
        scored = sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt)).result()
        assert scored == [None] + [pytest.approx(prompt_logprob(k)) for k in (1, 2, 3)]
        last = sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt), prompt_logprobs_last_n=1).result()
        assert last == [None, None, None, pytest.approx(prompt_logprob(3))]
        with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
            sampler.sample(tinker.ModelInput.from_ints(prompt), 1, tinker.SamplingParams(max_tokens=1),
                           topk_prompt_logprobs=2).result()
    assert [u["model"] for u in w.upstream()] == ["acme@v7"] * 3
    assert np.isfinite([lp for s in out.sequences for lp in s.logprobs]).all()


# --- the session records in real Redis ---------------------------------------------------------

@pytest.mark.integration
def test_a_session_the_learner_records_in_redis_reads_back_on_the_asyncio_client(redis_client, stack):
    import redis.asyncio

    sid = sampling_session_id_of(f"sess-{uuid.uuid4().hex[:8]}", 0)
    put_sampling_session(redis_client, sid, "acme", "acme@v3", PATH)
    assert get_sampling_session(redis_client, sid) == SamplingSession("acme", "acme@v3", PATH)

    async def back() -> tuple:
        client = redis.asyncio.Redis.from_url(stack.redis_url)
        try:
            await aput_sampling_session(client, sid + "b", "beta", "base")
            return await aget_sampling_session(client, sid), await aget_sampling_session(client, sid + "b")
        finally:
            await client.aclose()
    assert asyncio.run(back()) == (SamplingSession("acme", "acme@v3", PATH), SamplingSession("beta", "base"))
    assert get_sampling_session(redis_client, sid + "-unknown") is None

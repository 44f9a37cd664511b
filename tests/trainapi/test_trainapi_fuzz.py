"""Fuzz the Tinker-compatible training API (`/api/v1/...`, with a real learner on the tiny model and
the real Redis behind it). Whatever the body, the protobuf, its Content-Encoding, the key or the
path ids:

- it never answers 5xx and the keep-alive connection stays usable (`tests.fuzz.assert_door_holds`);
- every 4xx is a non-empty JSON body in clora's shape `{"error": {"code", "message", "field"}}`
  naming the field (the SDK takes an empty 400 for a network fault and retries it); a 413 names
  none (the whole body is too large), and `retrieve_future`'s 408 is the protocol's `try_again`;
- a refused request leaves the fuzzed model as it was: its step in the learner's store, its
  requests queued and finished (`clora.trainapi.queue`) and the set of runs. A body still valid
  after its mutation may be accepted: then it answers a request id, and the learner must not fail
  it as a server error.

Requests come from hypothesis strategies (`tests.fuzz`): odd values in each field of a valid body
(nested ones included), fields left out, unknown fields and whole bodies that are not one object;
for `forward_backward`, a valid `ForwardBackwardRequest` with one field made odd, its bytes cut,
flipped or padded, Content-Encodings other than zstd, broken zstd frames and zstd bombs.

`asample` runs on the gateway, which this fixture does not start. The door answers a valid
`asample` with its future at once and waits out an unreachable gateway in the background until
`sample_timeout_s`, then fails the future (category `server`): never a 502/503 of its own.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import zstandard
from fastapi import FastAPI
from hypothesis import given, reject
from hypothesis import strategies as st

from clora.trainapi import queue
from clora.trainapi.backend import run_key
from clora.trainapi.wire import DTYPE_FLOAT32, DTYPE_INT64, ForwardBackwardRequest
from tests.fuzz import (ODD_IDS, ErrorLog, Mutation, Raw, Removal, assert_door_holds, dumps, fuzz_settings,
                        header_values, keepalive_client, mutations, nested, odd_bodies, paths_in, removals,
                        server_errors)

from .conftest import RANK, TinkerService

pytestmark = pytest.mark.integration   # the service fixture runs on the suite's Redis

V1 = "/api/v1"
JSON = {"Content-Type": "application/json"}
PROTOBUF = {"Content-Type": "application/x-protobuf"}
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}


# --- the fuzzed model and what a refusal must leave alone ------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """What a refused request must leave as it was."""

    step: int | None
    """The model's optimizer steps in the learner's store; None while the run is out of memory."""
    waiting: int
    """Its requests queued for the learner."""
    done: int
    """Its requests the learner finished."""
    runs: frozenset[str]
    """Every Tinker run (a refused `create_model` adds none)."""


class Door:
    """One keep-alive connection to the API with acme's key, and what valid bodies name: an open
    session and a model of it (created), and, made on first use, a saved checkpoint, saved sampler
    weights and a sampling session."""

    def __init__(self, service: TinkerService, client: httpx.Client, log: ErrorLog):
        self.service, self.client, self.log = service, client, log
        self._numbers = itertools.count(1)
        self.session_id = self.post("create_session", {"tags": [], "sdk_version": "fuzz"}).json()["session_id"]
        created = self.post("create_model", {"session_id": self.session_id, "model_seq_id": 0, "base_model": "tiny",
                                             "lora_config": {"rank": RANK}}).json()
        self.model_id, self.created = created["model_id"], created["request_id"]
        self.outcome(self.created)
        self.run = run_key("acme", self.model_id)

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        r = self.client.post(f"{V1}/{route}", content=dumps(body), headers=JSON)
        assert r.status_code == 200, f"{route}: {r.status_code} {r.text}"
        return r

    def valid(self) -> httpx.Response:
        """The request `assert_door_holds` sends after each fuzzed one (it changes nothing)."""
        return self.client.post(f"{V1}/get_info", content=dumps({"model_id": self.model_id}), headers=JSON)

    def number(self) -> int:
        """A number no earlier body of this door used (model and sampling seq ids, names)."""
        return next(self._numbers)

    @property
    def app(self) -> FastAPI:
        """The app uvicorn serves."""
        return self.service.server.server.config.app

    def next_seq_id(self) -> int:
        """The model's next `seq_id`, as the service's sequencer expects it."""
        return self.app.state.trainapi.models[self.model_id].sequencer.next

    def snapshot(self) -> Snapshot:
        store, r = self.service.learner.store, self.service.redis
        return Snapshot(step=store.peek(self.run).step if self.run in store else None,
                        waiting=queue.waiting(r, [self.run])[self.run], done=queue.run_meta(r, self.run)[0],
                        runs=frozenset(queue.runs(r)))

    def outcome(self, request_id: str, timeout_s: float = 60.0) -> dict:
        """The finished future of `request_id` (long-polled through `retrieve_future`); the
        learner must not have failed it as a server error."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.client.post(f"{V1}/retrieve_future", content=dumps({"request_id": request_id}), headers=JSON)
            if r.status_code != 408:
                break
            assert time.monotonic() < deadline, f"request {request_id} did not finish within {timeout_s:g} s"
        assert r.status_code == 200, f"retrieve_future {request_id}: {r.status_code} {r.text}"
        out = r.json()
        assert not (isinstance(out.get("error"), str) and out.get("category") == "server"), (
            f"the learner failed request {request_id} as a server error: {out}\nserver log:\n{self.log.take()}")
        return out

    def save(self, route: str, name: str) -> str:
        """Save the model's weights as `name` through `route`; its tinker:// path."""
        r = self.post(route, {"model_id": self.model_id, "seq_id": self.next_seq_id(), "path": name})
        return self.outcome(r.json()["request_id"])["path"]

    @cached_property
    def checkpoint(self) -> str:
        return self.save("save_weights", "fuzz-ckpt")

    @cached_property
    def sampler_path(self) -> str:
        return self.save("save_weights_for_sampler", "fuzz-sampler")

    @cached_property
    def sampling_session(self) -> str:
        return self.post("create_sampling_session", {"session_id": self.session_id, "sampling_session_seq_id": 0,
                                                     "base_model": "tiny"}).json()["sampling_session_id"]


@pytest.fixture
def door(service):
    with keepalive_client(service.url) as client, server_errors() as log:
        client.headers["X-API-Key"] = service.keys["acme"]
        yield Door(service, client, log)
    assert service._thread.is_alive(), "the learner died"


def assert_error_shape(r: httpx.Response, fields: set[str]) -> None:
    """A 4xx is clora's error envelope naming the field (none for a 413), or `try_again` (408).
    The field is `X-API-Key`, `body` or a field of the request: its first part is in `fields`."""
    if r.status_code < 400:
        return
    if r.status_code == 408:
        assert r.json().get("type") == "try_again", r.text
        return
    assert r.content, f"an empty {r.status_code}: the SDK takes it for a network fault"
    error = r.json().get("error")
    assert isinstance(error, dict) and set(error) == {"code", "message", "field"}, r.text
    assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str) and \
        error["message"], r.text
    if r.status_code == 413:
        return
    field = error["field"]
    assert isinstance(field, str) and field.split(".")[0] in fields | {"X-API-Key", "body"}, (
        f"{r.status_code} names {field!r}, not one of the request's fields {sorted(fields)}: {r.text}")


# --- the JSON routes ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    """A JSON route under /api/v1 and a valid body for it (`body(door)`, fresh per example)."""

    path: str
    body: Callable[[Door], dict[str, Any]]
    learner: bool = False
    """An accepted request runs on the learner: its answer is a future the test waits for."""
    future: bool = False
    """An accepted request answers a future's request id (the learner's, or a sample's)."""
    also: tuple[str, ...] = ()
    """Fields an error may name that the valid body does not hold (the alternative it asks for)."""

    def fields(self, door: Door) -> set[str]:
        return {*self.body(door), *self.also}


ROUTES: dict[str, Route] = {r.path: r for r in [
    Route("client/config", lambda d: {"sdk_version": "0.38.0"}),
    Route("client/dynamic_config", lambda d: {"sdk_version": "0.38.0"}),
    Route("telemetry", lambda d: {"events": [{"event": "generic_event", "event_id": "e-1", "event_session_index": 0,
                                              "severity": "INFO", "timestamp": "2026-01-01T00:00:00Z",
                                              "event_name": "fuzz", "event_data": {"k": 1}}],
                                  "platform": "linux", "sdk_version": "0.38.0", "session_id": d.session_id}),
    Route("create_session", lambda d: {"tags": ["fuzz"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0",
                                       "type": "create_session"}),
    Route("session_heartbeat", lambda d: {"session_id": d.session_id, "type": "session_heartbeat"}),
    Route("sessions/{session_id}/finish", lambda d: {"reason": {"type": "success"}}, also=("path",)),
    Route("create_model", lambda d: {"session_id": d.session_id, "model_seq_id": d.number(), "base_model": "tiny",
                                     "lora_config": {"rank": RANK, "seed": 3, "train_unembed": True, "train_mlp": True,
                                                     "train_attn": True},
                                     "optimizer_config": {"type": "adamw"}, "type": "create_model"},
          learner=True, future=True),
    Route("get_info", lambda d: {"model_id": d.model_id, "type": "get_info"}),
    Route("optim_step", lambda d: {"model_id": d.model_id, "seq_id": d.next_seq_id(), "adam_params": dict(ADAM),
                                   "type": "optim_step"}, learner=True, future=True),
    Route("save_weights", lambda d: {"model_id": d.model_id, "seq_id": d.next_seq_id(), "path": f"w-{d.number()}",
                                     "overwrite": False, "type": "save_weights"}, learner=True, future=True),
    Route("save_weights_for_sampler", lambda d: {"model_id": d.model_id, "seq_id": d.next_seq_id(),
                                                 "path": f"s-{d.number()}", "type": "save_weights_for_sampler"},
          learner=True, future=True),
    Route("load_weights", lambda d: {"model_id": d.model_id, "seq_id": d.next_seq_id(), "path": d.checkpoint,
                                     "optimizer": True, "type": "load_weights"}, learner=True, future=True),
    Route("weights_info", lambda d: {"tinker_path": d.checkpoint, "type": "weights_info"}),
    Route("retrieve_future", lambda d: {"request_id": d.created, "allow_metadata_only": False,
                                        "type": "retrieve_future"}),
    Route("create_sampling_session", lambda d: {"session_id": d.session_id, "sampling_session_seq_id": d.number(),
                                                "base_model": None, "model_path": d.sampler_path,
                                                "type": "create_sampling_session"}),
    Route("asample", lambda d: {"sampling_session_id": d.sampling_session, "seq_id": d.number(), "num_samples": 2,
                                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                                "sampling_params": {"max_tokens": 4, "seed": 0, "stop": ["\n"], "temperature": 1.0,
                                                    "top_k": -1, "top_p": 1.0},
                                "prompt_logprobs": True, "prompt_logprobs_last_n": 2, "topk_prompt_logprobs": 0,
                                "type": "sample"}, future=True, also=("model_path",)),
]}
LOAD_AS_NEW_MODEL = Route("load_weights", lambda d: {"session_id": d.session_id, "model_seq_id": d.number(),
                                                     "path": d.checkpoint, "optimizer": True, "base_model": "tiny",
                                                     "type": "load_weights"}, learner=True, future=True,
                          also=("model_id", "seq_id"))
"""`load_weights` form A: a new model from the checkpoint (without `session_id`, form B's fields)."""
CASES = {**ROUTES, "load_weights (new model)": LOAD_AS_NEW_MODEL}
ELSEWHERE = {"forward_backward": "a protobuf body: the tests at the end",
             "samplers/{sampling_session_id}": "takes an id in its path: test_odd_ids_in_the_path_never_5xx",
             "get_server_capabilities": "takes only the key: test_odd_api_keys_answer_401",
             "healthz": "takes nothing, not even a key"}
"""The routes fuzzed other than by JSON bodies, and where."""


def test_every_route_is_fuzzed(door):
    served = {route.path.removeprefix(f"{V1}/") for route in door.app.routes if route.path.startswith(V1)}
    assert served == set(ROUTES) | set(ELSEWHERE)


def places(body: dict[str, Any]) -> list[tuple]:
    """Where to put odd values: each field (nested ones too), one item past the end of each
    list, and an unknown field (whole bodies: `test_odd_whole_bodies_never_5xx`)."""
    inside = paths_in(body)
    past_end = [(*p, len(v)) for p in inside if isinstance(v := _at(body, p), list)]
    return [*inside, *past_end, ("unknown_field",)]


def _at(body: Any, path: tuple) -> Any:
    for step in path:
        body = body[step]
    return body


def changes(body: dict[str, Any]) -> st.SearchStrategy[Mutation | Removal]:
    """Two thirds odd values in a field of `body` (or a new one), a third fields left out."""
    odd_field = mutations(places(body))
    return st.one_of(odd_field, odd_field, removals(paths_in(body)))


def assert_effect(door: Door, route: Route, r: httpx.Response, before: Snapshot) -> None:
    """An accepted future-answering request carries its request id (a learner's is then waited
    for); anything else left the fuzzed model as it was."""
    if r.status_code == 200 and route.future:
        rid = r.json().get("request_id")
        assert isinstance(rid, str) and rid, f"accepted without a request id: {r.text}"
        if route.learner:
            door.outcome(rid)
            return
    assert door.snapshot() == before, f"answered {r.status_code} {r.text[:300]} and changed the model's state"


def send(door: Door, route: Route, content: bytes) -> httpx.Response:
    fields = route.fields(door)   # first: it may save the checkpoint a valid body names
    before = door.snapshot()
    r = assert_door_holds(door.client, "POST", f"{V1}/{route.path.format(session_id=door.session_id)}", door.valid,
                          content=content, headers=JSON, log=door.log)
    assert_error_shape(r, fields)
    assert_effect(door, route, r, before)
    return r


@pytest.mark.parametrize("case", list(CASES))
def test_odd_values_in_any_field_never_5xx_and_a_refusal_changes_nothing(door, case):
    route = CASES[case]

    @fuzz_settings(60)
    @given(change=changes(route.body(door)))
    def run(change):
        send(door, route, dumps(change.apply(route.body(door))))

    run()


WORST = [Raw('"\\ud800"', "lone surrogate"), Raw("NaN"), Raw("1" + "0" * 400, "int of 401 digits"),
         nested(10_000), Raw("null")]
"""A string that cannot be encoded, a number that is not one, an int no 64-bit type holds,
nesting past the recursion limit, and nothing: put in every field of every route by
`test_the_worst_values_in_every_field_of_every_route_never_5xx` (hypothesis samples the fields;
the sweep misses none)."""


def test_the_worst_values_in_every_field_of_every_route_never_5xx(door):
    for case, route in CASES.items():
        for place in places(route.body(door)):
            for value in WORST:
                send(door, route, dumps(Mutation(place, value).apply(route.body(door))))


def test_odd_whole_bodies_never_5xx(door):
    """Bodies that are not one JSON object (odd values, invalid JSON or UTF-8, deep nesting), to
    every JSON route."""

    @fuzz_settings(80)
    @given(case=st.sampled_from(list(CASES)), content=odd_bodies())
    def run(case, content):
        r = send(door, CASES[case], content)
        too_large = len(content) > door.service.settings.max_body_bytes
        assert r.status_code in ((413,) if too_large else (200, 400, 422)), (case, len(content), r.status_code, r.text)

    run()


def test_a_valid_asample_without_a_gateway_answers_its_future_not_a_5xx(door):
    """This fixture starts no gateway. `asample` answers its future at once, one sequence id per
    sample, and the sample waits for the gateway in the background until `sample_timeout_s`: the
    future stays pending (408 `try_again`), or fails if something else answers on the gateway's
    port; never a 502/503 of this door."""
    body = ROUTES["asample"].body(door)
    r = door.client.post(f"{V1}/asample", content=dumps(body), headers=JSON)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    assert r.json()["sample_sequence_ids"] == [f"{rid}:{i}" for i in range(body["num_samples"])]
    future = door.client.post(f"{V1}/retrieve_future", content=dumps({"request_id": rid}), headers=JSON)
    assert future.status_code == 408 and future.json()["type"] == "try_again" or \
        future.status_code == 200 and "error" in future.json(), future.text


def test_num_samples_past_the_limit_is_400_before_any_sequence_id_is_made(door, service):
    limit = service.settings.max_num_samples
    for n in (limit + 1, 10**12):
        r = door.client.post(f"{V1}/asample", content=dumps({**ROUTES["asample"].body(door), "num_samples": n}),
                             headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["field"] == "num_samples", r.text


def _path_id(s: str) -> str:
    return quote(s, safe="", errors="surrogatepass")


@pytest.mark.parametrize("method, path", [("POST", "sessions/{}/finish"), ("GET", "samplers/{}")])
def test_odd_ids_in_the_path_never_5xx(door, service, method, path):
    """Ids with a trailing newline, '/', NUL, surrogates (percent-encoded), nothing or far too
    much, and the other tenant's own."""
    beta = httpx.post(f"{service.url}{V1}/create_session", json={}, headers={"X-API-Key": service.keys["beta"]})
    ids = (st.sampled_from(ODD_IDS) | st.text(max_size=30)
           | st.sampled_from([beta.json()["session_id"], f"{door.session_id}:sample:0", door.session_id + "\n",
                              door.session_id.upper()]))

    @fuzz_settings(30)
    @given(odd=ids)
    def run(odd):
        before = door.snapshot()
        r = assert_door_holds(door.client, method, f"{V1}/{path.format(_path_id(odd))}", door.valid,
                              content=dumps({"reason": {"type": "success"}}) if method == "POST" else None,
                              headers=JSON, log=door.log)
        assert_error_shape(r, {"path", "session_id", "sampling_session_id"})
        assert r.status_code in (404, 405), (odd, r.status_code, r.text)
        assert door.snapshot() == before

    run()


@pytest.mark.parametrize("method, route", [("POST", "get_info"), ("POST", "optim_step"), ("POST", "forward_backward"),
                                           ("POST", "asample"), ("GET", "get_server_capabilities")])
def test_odd_api_keys_answer_401(door, method, route):
    body = None if method == "GET" else b"\x00" if route == "forward_backward" else dumps(ROUTES[route].body(door))
    keys = header_values() | st.sampled_from([b"tml-", b"tml-nope", b"tml-" + b"x" * 5000, b"TML-x", b" tml-x",
                                              b"tml-\xe9", b"Bearer tml-x"])

    @fuzz_settings(20)
    @given(value=keys)
    def run(value):
        before = door.snapshot()
        r = assert_door_holds(door.client, method, f"{V1}/{route}", door.valid, content=body,
                              headers={**JSON, "X-API-Key": value}, log=door.log)
        assert_error_shape(r, set())
        assert r.status_code == 401 and r.json()["error"]["field"] == "X-API-Key", (value, r.status_code, r.text)
        assert door.snapshot() == before

    run()


# --- forward_backward: protobuf --------------------------------------------------------------

FORWARD_BACKWARD = Route("forward_backward", lambda d: {}, learner=True, future=True)
FORWARD_BACKWARD_FIELDS = {"content-encoding", "model_id", "seq_id", "loss_fn", "loss_fn_config", "data"}
"""What a refused `forward_backward` may name: the header, or a field of the protobuf."""


def fwdbwd(model_id: str, seq_id: int):
    """A valid `ForwardBackwardRequest`: one SFT datum of 3 tokens."""
    req = ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.array([5, 6, 7], dtype="<i4").tobytes()
    _dense(d.loss_fn_inputs["target_tokens"], np.array([6, 7, 8], dtype="<i8"), DTYPE_INT64)
    _dense(d.loss_fn_inputs["weights"], np.array([0, 1, 1], dtype="<f4"), DTYPE_FLOAT32)
    return req


def _dense(t, values: np.ndarray, dtype: int) -> None:
    t.dense, t.dtype = values.tobytes(), dtype


def _set(attr: str, value: Any) -> Callable:
    def edit(req) -> None:
        setattr(req, attr, value)
    return edit


def _datum(edit: Callable) -> Callable:
    return lambda req: edit(req.data[0])


def _input(name: str, values: np.ndarray | bytes, dtype: int, shape: list[int] | None = None) -> Callable:
    def edit(d) -> None:
        t = d.loss_fn_inputs[name]
        t.dense = values if isinstance(values, bytes) else values.tobytes()
        t.dtype = dtype
        if shape is not None:
            t.shape.extend(shape)
    return _datum(edit)


def _tokens(raw: bytes) -> Callable:
    def edit(d) -> None:
        d.model_input[0].encoded_text.tokens = raw
    return _datum(edit)


def _config(key: str, number: float | None = None, text: str | None = None, legacy: bool = False) -> Callable:
    def edit(req) -> None:
        if legacy:
            req.loss_fn_config[key] = number
        elif text is not None:
            req.loss_fn_config_v2[key].text = text
        else:
            req.loss_fn_config_v2[key].number = number
    return edit


def _chunk(kind: str) -> Callable:
    def edit(d) -> None:
        c = d.model_input.add()
        if kind == "image":
            c.image.data, c.image.format, c.image.expected_tokens = b"\x89PNG", "png", 2**31 - 1
        elif kind == "dmel":
            c.dmel.dmel = b"\x00" * 8
    return _datum(edit)


def _many_datums(n: int, length: int) -> Callable:
    def edit(req) -> None:
        del req.data[:]
        for _ in range(n):
            d = req.data.add()
            d.model_input.add().encoded_text.tokens = np.arange(length, dtype="<i4").tobytes()
            _dense(d.loss_fn_inputs["target_tokens"], np.arange(1, length + 1, dtype="<i8"), DTYPE_INT64)
            _dense(d.loss_fn_inputs["weights"], np.ones(length, dtype="<f4"), DTYPE_FLOAT32)
    return edit


def _without(name: str) -> Callable:
    return _datum(lambda d: d.loss_fn_inputs.pop(name))


def _sparse(d) -> None:
    t = d.loss_fn_inputs["target_tokens"]
    t.sparse_csr.values, t.sparse_csr.crow_indices, t.sparse_csr.col_indices = b"\x01" * 8, b"\x00" * 8, b"\xff" * 8


NAN, INF = np.float32("nan"), np.float32("inf")
INPUT, TARGETS, WEIGHTS = "data.0.model_input", "data.0.loss_fn_inputs.target_tokens", "data.0.loss_fn_inputs.weights"
TARGET_VALUES = np.array([6, 7, 8], dtype="<i8")
EDITS: dict[str, tuple[Callable, str | None]] = {
    "loss_fn empty": (_set("loss_fn", ""), "loss_fn"), "loss_fn dro": (_set("loss_fn", "dro"), "loss_fn"),
    "loss_fn with newline": (_set("loss_fn", "cross_entropy\n"), "loss_fn"),
    "loss_fn ppo without its inputs": (_set("loss_fn", "ppo"), "data.0.loss_fn_inputs.logprobs"),
    "model_id empty": (_set("model_id", ""), "model_id"),
    "model_id of 10,000 chars": (_set("model_id", "x" * 10_000), "model_id"),
    "model_id with NUL": (_set("model_id", "a\x00b"), "model_id"),
    "seq_id -1": (_set("seq_id", -1), "seq_id"), "seq_id 0": (_set("seq_id", 0), "seq_id"),
    "seq_id int32 max": (_set("seq_id", 2**31 - 1), "seq_id"),
    "forward_only": (_set("forward_only", True), None),
    "no datums": (lambda req: req.ClearField("data"), "data"),
    "65 tokens (over max_context_length)": (_many_datums(1, 65), INPUT), "200 datums": (_many_datums(200, 3), None),
    "tokens not whole int32s": (_tokens(b"\x05\x00\x00"), f"{INPUT}.0.tokens"), "tokens empty": (_tokens(b""), INPUT),
    "token -1": (_tokens(np.array([-1, 6, 7], dtype="<i4").tobytes()), INPUT),
    "token int32 max": (_tokens(np.array([5, 2**31 - 1, 7], dtype="<i4").tobytes()), INPUT),
    "no model_input": (_datum(lambda d: d.ClearField("model_input")), INPUT),
    "an empty chunk": (_chunk("empty"), f"{INPUT}.1"), "an image chunk": (_chunk("image"), f"{INPUT}.1"),
    "a dmel chunk": (_chunk("dmel"), f"{INPUT}.1"),
    "target_tokens float32": (_input("target_tokens", np.array([6, 7, 8], dtype="<f4"), DTYPE_FLOAT32), TARGETS),
    "target_tokens out of vocab": (_input("target_tokens", np.array([6, 7, 10**9], dtype="<i8"), DTYPE_INT64),
                                   TARGETS),
    "target_tokens negative": (_input("target_tokens", np.array([6, -7, 8], dtype="<i8"), DTYPE_INT64), TARGETS),
    "target_tokens 2 values": (_input("target_tokens", np.array([6, 7], dtype="<i8"), DTYPE_INT64), TARGETS),
    "target_tokens odd bytes": (_input("target_tokens", b"\x01" * 13, DTYPE_INT64), TARGETS),
    "target_tokens dtype 0": (_input("target_tokens", TARGET_VALUES, 0), TARGETS),
    "target_tokens dtype 99": (_input("target_tokens", TARGET_VALUES, 99), TARGETS),
    "target_tokens shape [3, 1]": (_input("target_tokens", TARGET_VALUES, DTYPE_INT64, [3, 1]), TARGETS),
    "target_tokens shape [-3]": (_input("target_tokens", TARGET_VALUES, DTYPE_INT64, [-3]), TARGETS),
    "target_tokens sparse": (_datum(_sparse), TARGETS), "no target_tokens": (_without("target_tokens"), TARGETS),
    "weights NaN": (_input("weights", np.array([0, NAN, 1], dtype="<f4"), DTYPE_FLOAT32), WEIGHTS),
    "weights Infinity": (_input("weights", np.array([0, INF, 1], dtype="<f4"), DTYPE_FLOAT32), WEIGHTS),
    "weights int64": (_input("weights", np.array([0, 1, 1], dtype="<i8"), DTYPE_INT64), WEIGHTS),
    "no weights": (_without("weights"), WEIGHTS),
    "weights 3e38 (the loss overflows: a user error)": (
        _input("weights", np.array([0, 3e38, 3e38], dtype="<f4"), DTYPE_FLOAT32), None),
    "advantages too": (_input("advantages", np.array([1, 1, 1], dtype="<f4"), DTYPE_FLOAT32), None),
    "clip_eps NaN (v2)": (_config("clip_eps", float("nan")), "loss_fn_config.clip_eps"),
    "clip_eps text": (_config("clip_eps", text="0.2"), "loss_fn_config.clip_eps"),
    "config -Infinity (legacy)": (_config("x", float("-inf"), legacy=True), "loss_fn_config.x"),
    "config 1e308": (_config("x", 1e308), "loss_fn_config.x"),
    "config key empty": (_config("", 0.5), "loss_fn_config."),
}
"""Named edits of a valid `ForwardBackwardRequest` and the field the refusal names (None: it is
accepted): each protocol rule `wire` and `losses` check, and values no rule names."""


def edited(door: Door, name: str) -> bytes:
    req = fwdbwd(door.model_id, door.next_seq_id())
    EDITS[name][0](req)
    return req.SerializeToString()


def send_protobuf(door: Door, content: bytes, headers: dict[str, Any] | None = None) -> httpx.Response:
    before = door.snapshot()
    r = assert_door_holds(door.client, "POST", f"{V1}/forward_backward", door.valid, content=content,
                          headers={**PROTOBUF, **(headers or {})}, log=door.log)
    assert_error_shape(r, FORWARD_BACKWARD_FIELDS)
    assert_effect(door, FORWARD_BACKWARD, r, before)
    return r


def test_each_named_protobuf_edit_is_refused_naming_its_field_or_accepted(door):
    for name, (_, field) in EDITS.items():
        r = send_protobuf(door, edited(door, name))
        if field is None:
            assert r.status_code == 200, (name, r.status_code, r.text)
        else:
            assert r.status_code in (400, 404) and r.json()["error"]["field"] == field, (name, r.status_code, r.text)


def test_odd_protobuf_fields_never_5xx(door):
    """Hypothesis-drawn values in the request's scalar fields and the datum's tokens and inputs."""
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    ints = st.integers(-(2**31), 2**31 - 1)
    edits = st.one_of(
        st.builds(_set, st.just("model_id"), st.sampled_from([s for s in ODD_IDS if "\ud800" not in s]) | st.text()),
        st.builds(_set, st.just("seq_id"), ints),
        st.builds(_set, st.just("loss_fn"), st.sampled_from(["cross_entropy", "ppo", "importance_sampling"])
                  | st.text(max_size=20)),
        st.builds(_tokens, st.binary(max_size=80)),
        st.builds(_tokens, st.lists(ints, min_size=1, max_size=70).map(lambda v: np.array(v, "<i4").tobytes())),
        st.builds(lambda v: _input("weights", np.array(v, "<f4"), DTYPE_FLOAT32), st.lists(floats, min_size=1,
                                                                                            max_size=4)),
        st.builds(lambda v: _input("target_tokens", np.array(v, "<i8"), DTYPE_INT64),
                  st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4)),
        st.builds(lambda b, t: _input("weights", b, t), st.binary(max_size=24), st.integers(0, 2**31 - 1)),
        st.builds(lambda k, v: _config(k, v), st.text(max_size=10), st.floats()),
    )

    @fuzz_settings(60)
    @given(edit=edits)
    def run(edit):
        req = fwdbwd(door.model_id, door.next_seq_id())
        try:
            edit(req)
            content = req.SerializeToString()
        except (ValueError, TypeError):   # protobuf refuses the value on this side (not UTF-8, ...)
            reject()
        send_protobuf(door, content)

    run()


def test_mangled_protobuf_bytes_never_5xx(door):
    """A valid body cut short, with a byte flipped, with bytes appended, twice over, or random bytes."""
    mangles = st.one_of(
        st.builds(lambda n: lambda b: b[:n], st.integers(0, 60)),
        st.builds(lambda i, x: lambda b: b[:i % len(b)] + bytes([x]) + b[i % len(b) + 1:], st.integers(0, 200),
                  st.integers(0, 255)),
        st.builds(lambda tail: lambda b: b + tail, st.binary(min_size=1, max_size=40)),
        st.just(lambda b: b + b),
        st.builds(lambda junk: lambda b: junk, st.binary(max_size=200)),
    )

    @fuzz_settings(40)
    @given(mangle=mangles)
    def run(mangle):
        send_protobuf(door, mangle(fwdbwd(door.model_id, door.next_seq_id()).SerializeToString()))

    run()


ZSTD = zstandard.ZstdCompressor()
ENCODINGS = [b"gzip", b"br", b"deflate", b"zstd, gzip", b"gzip, zstd", b"ZSTD", b" zstd ", b"identity", b"",
             b"x" * 2000, b"zstd\xe9", b"compress", b"*"]


def test_odd_content_encodings_never_5xx(door):
    """Each encoding over a plain body, a zstd body, broken zstd frames and random bytes."""
    bodies = st.sampled_from(["plain", "zstd", "zstd cut short", "zstd with junk after", "two zstd frames",
                              "zstd of junk", "junk"])

    @fuzz_settings(40)
    @given(encoding=st.sampled_from(ENCODINGS) | header_values(), kind=bodies, junk=st.binary(max_size=64))
    def run(encoding, kind, junk):
        plain = fwdbwd(door.model_id, door.next_seq_id()).SerializeToString()
        packed = ZSTD.compress(plain)
        content = {"plain": plain, "zstd": packed, "zstd cut short": packed[:len(packed) // 2],
                   "zstd with junk after": packed + junk, "two zstd frames": packed + packed,
                   "zstd of junk": ZSTD.compress(junk), "junk": junk}[kind]
        send_protobuf(door, content, {"Content-Encoding": encoding})

    run()


def test_zstd_bombs_beyond_the_decompressed_limit_are_413(door, service):
    limit = service.settings.max_decompressed_bytes
    valid = fwdbwd(door.model_id, 1).SerializeToString()
    bombs = {"one byte over": b"\x00" * (limit + 1), "100 MiB of zeros": b"\x00" * (100 << 20),
             "a valid body padded past the limit": valid + b"\x0a\x00" * (limit // 2)}
    streamed = zstandard.ZstdCompressor(write_content_size=False)
    for name, raw in bombs.items():
        for compressor in (ZSTD, streamed):
            packed = compressor.compress(raw)
            assert len(packed) < service.settings.max_body_bytes, name
            r = send_protobuf(door, packed, {"Content-Encoding": "zstd"})
            assert r.status_code == 413, (name, r.status_code, r.text)
    r = send_protobuf(door, b"\x00" * (service.settings.max_body_bytes + 1))
    assert r.status_code == 413, r.text

"""The shared HTTP front door (`clora.web`): credentials read from headers, body limits by
declared length, by streamed bytes and by nesting depth, strings that must encode, the 422 naming
the field, and each door's error shape."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field, ValidationError

from clora.web import (MAX_JSON_DEPTH, BodyLimit, HttpError, Utf8Str, api_key, bearer_token, first_error,
                       install_error_handlers, read_body, too_deep)


def test_an_error_renders_in_each_shape():
    e = HttpError(403, "forbidden", "not yours", "interaction_id", headers={"Retry-After": "1"})
    assert e.body("clora") == {"error": {"code": "forbidden", "message": "not yours", "field": "interaction_id"}}
    assert e.body("openai") == {"error": {"message": "not yours", "type": "invalid_request_error",
                                          "param": "interaction_id", "code": "forbidden"}}
    server = HttpError(503, "engine_unavailable", "down", type="server_error")
    assert server.body("openai")["error"]["type"] == "server_error"
    r = e.response("clora")
    assert r.status_code == 403 and r.headers["retry-after"] == "1"


@pytest.mark.parametrize("headers, bearer, key", [
    ({"authorization": "Bearer clk_1"}, "clk_1", "clk_1"),
    ({"authorization": "bearer   clk_2  "}, "clk_2", "clk_2"),          # any case, spaces stripped
    ({"authorization": "Bearer "}, "", ""),                                 # a bearer with no token
    ({"authorization": "Bearer", "x-api-key": "clk_3"}, "", "clk_3"),     # no scheme separator: not a bearer
    ({"authorization": "Basic abc", "x-api-key": "clk_4"}, "", "clk_4"),
    ({"x-api-key": "clk_5"}, "", "clk_5"),
    ({"authorization": "Bearer clk_6", "x-api-key": "clk_7"}, "clk_6", "clk_6"),  # the bearer wins
    ({}, "", ""),
])
def test_credentials_are_read_from_a_bearer_or_the_api_key_header(headers, bearer, key):
    assert bearer_token(headers) == bearer
    assert api_key(headers) == key


def test_first_error_names_the_field_without_fastapis_body_prefix():
    errors = [{"loc": ("body", "records", 3, "score"), "msg": "too big"}, {"loc": ("body", "x"), "msg": "no"}]
    assert first_error(errors) == ("records.3.score", "too big")
    assert first_error([{"loc": ("body",), "msg": "not an object"}]) == ("body", "not an object")
    assert first_error([{"loc": (), "msg": "bad"}], default="") == ("", "bad")
    assert first_error([]) == ("body", "invalid request")


def test_a_body_that_is_not_json_names_the_body_not_the_character_it_failed_at():
    errors = [{"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}]
    assert first_error(errors) == ("body", "not valid JSON at character 5: Expecting value")


def test_a_lone_surrogate_in_a_utf8_field_is_refused_naming_the_field():
    class Body(BaseModel):
        request_id: Utf8Str

    assert Body.model_validate(json.loads('{"request_id": "a\\ud83d\\ude00"}')).request_id == "a\U0001f600"
    with pytest.raises(ValidationError) as e:   # FastAPI reads a body with `json`, which decodes the surrogate
        Body.model_validate(json.loads('{"request_id": "ab\\ud800"}'))
    assert e.value.errors()[0]["loc"] == ("request_id",)
    assert "lone surrogate at character 2" in e.value.errors()[0]["msg"]


class Record(BaseModel):
    score: float = Field(ge=0, le=1)


class Batch(BaseModel):
    records: list[Record]


def app_with(shape, on_error=None, max_body_bytes: int | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, shape, on_error)
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes, shape=shape, on_error=on_error)
    app.state.bodies = []

    @app.post("/batch")
    async def batch(body: Batch):
        app.state.bodies.append(body)
        return {"n": len(body.records)}

    @app.get("/refuse")
    async def refuse():
        raise HttpError(429, "rate_limit_exceeded", "slow down", type="requests", headers={"retry-after": "2"})

    @app.post("/raw")
    async def raw(request: Request):
        return {"size": len(await read_body(request, 10))}

    return app


def test_an_http_error_raised_in_a_route_answers_in_the_doors_shape():
    statuses: list[int] = []
    r = TestClient(app_with("clora", statuses.append)).get("/refuse")
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json() == {"error": {"code": "rate_limit_exceeded", "message": "slow down", "field": None}}
    assert statuses == [429]
    r = TestClient(app_with("openai")).get("/refuse")
    assert r.json() == {"error": {"message": "slow down", "type": "requests", "param": None,
                                  "code": "rate_limit_exceeded"}}


def test_an_invalid_request_is_422_naming_the_field():
    statuses: list[int] = []
    client = TestClient(app_with("clora", statuses.append))
    r = client.post("/batch", json={"records": [{"score": 0.5}, {"score": 7}]})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["field"] == "records.1.score"
    assert error["message"].startswith("records.1.score: ")
    assert statuses == [422]
    r = TestClient(app_with("openai")).post("/batch", json={"records": "no"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "records"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_route_and_a_wrong_method_answer_in_the_envelope_not_fastapis_detail():
    statuses: list[int] = []
    client = TestClient(app_with("clora", statuses.append))
    r = client.get("/nowhere")
    assert r.status_code == 404
    assert r.json() == {"error": {"code": "not_found", "message": "GET /nowhere: no such route or file",
                                  "field": "path"}}
    r = client.delete("/batch")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"code": "method_not_allowed", "field": "path",
                                  "message": "DELETE /batch: the path does not take DELETE (allowed: POST)"}}
    assert statuses == [404, 405]
    r = TestClient(app_with("openai")).get("/nowhere")
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "GET /nowhere: no such route or file", "type": "invalid_request_error", "param": "path",
        "code": "not_found"}}


def test_a_body_fastapi_cannot_parse_is_a_400_naming_the_body():
    r = TestClient(app_with("clora")).post("/batch", content=b'{"records": []}\xff',   # not UTF-8
                                           headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"error": {"code": "invalid_request", "field": "body",
                                  "message": "body: There was an error parsing the body"}}


def test_body_limit_refuses_a_declared_length_over_the_limit_before_the_route_runs():
    statuses: list[int] = []
    app = app_with("clora", statuses.append, max_body_bytes=64)
    client = TestClient(app)
    big = b'{"records": [' + b",".join([b'{"score": 0.5}'] * 10) + b"]}"
    r = client.post("/batch", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and f"{len(big)} bytes" in r.json()["error"]["message"]
    assert statuses == [413] and app.state.bodies == []
    small = client.post("/batch", json={"records": [{"score": 0.5}]})
    assert small.status_code == 200 and small.json() == {"n": 1}


def test_body_limit_counts_a_chunked_body_as_it_streams():
    app = app_with("openai", max_body_bytes=64)

    def chunks():
        for _ in range(20):
            yield b"x" * 10

    r = TestClient(app).post("/batch", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers          # sent chunked: counted, not declared
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and r.json()["error"]["type"] == "invalid_request_error"
    assert app.state.bodies == []


def test_read_body_returns_the_body_within_the_limit_and_refuses_past_it():
    client = TestClient(app_with("openai"))
    assert client.post("/raw", content=b"0123456789").json() == {"size": 10}
    declared = client.post("/raw", content=b"x" * 11)
    assert declared.status_code == 413 and "of 11 bytes" in declared.json()["error"]["message"]

    def chunks():
        yield b"x" * 6
        yield b"x" * 6

    streamed = client.post("/raw", content=chunks())
    assert "content-length" not in streamed.request.headers
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert streamed.json()["error"]["message"] == "request body exceeds the limit of 10 bytes"


@pytest.mark.parametrize("text, limit, where", [
    ('{"a": [[1]]}', 2, ["a", 0]),
    ('{"a": [1]}', 2, None),
    ('{"a": "[[[[[[{{{{"}', 2, None),                      # brackets inside strings do not count
    ('{"a\\"b": {"c": [1, 2, [3]]}}', 3, ['a"b', "c", 2]),  # escaped quotes, array indices
    ("]]][[[[[", 2, None),                                  # a parser stops at the first stray bracket
    ("[[[", 2, [0, 0]),                                      # not JSON: measured by its brackets all the same
    ('{"records": [{"z": ' + "[" * 5000 + "]" * 5000 + "}]}", MAX_JSON_DEPTH, ["records", 0, "z"] + [0] * 61),
])
def test_too_deep_names_the_first_value_nested_past_the_limit(text, limit, where):
    assert too_deep(text, limit) == where
    assert too_deep(text.encode(), limit) == where


def test_too_deep_never_recurses_whatever_the_depth():
    assert len(too_deep("[" * 1_000_000)) == MAX_JSON_DEPTH
    assert too_deep("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is None


def test_body_limit_refuses_a_body_nested_past_max_depth_naming_where_before_the_route_runs():
    app = app_with("clora")
    app.add_middleware(BodyLimit, max_bytes=1 << 20, shape="clora", max_depth=8)
    client = TestClient(app)
    deep = b'{"records": [{"score": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    r = client.post("/batch", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "too_deeply_nested" and error["field"] == "records.0.score.0.0.0.0.0"
    assert "deeper than 8 levels" in error["message"] and app.state.bodies == []
    assert client.post("/batch", json={"records": [{"score": 0.5}]}).json() == {"n": 1}

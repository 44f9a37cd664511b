"""Fuzz the feedback webhook (`/v1/feedback`, `/v1/feedback/batch`, with the real broker and
Redis behind it): whatever the body, key or signature headers, it never answers 5xx and the
keep-alive connection stays usable (`tests.fuzz.assert_door_holds`).

Two sources of requests: schemathesis, from the webhook's own /openapi.json (schema-valid and
schema-invalid bodies), and hypothesis strategies for odd values (`tests.fuzz`) put into each
field of a valid record, the whole body, the API key and the HMAC signature headers.
"""

from __future__ import annotations

import time
import uuid

import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st

from clora.registry import sign
from tests.fuzz import (ODD_SIGNATURES, ODD_TIMESTAMPS, assert_door_holds, dumps, fuzz_settings, header_values,
                        keepalive_client, mutations, odd_bodies, send_case, server_errors)

pytestmark = pytest.mark.integration
PATHS = ["/v1/feedback", "/v1/feedback/batch"]

RECORD = {"interaction_id": "chatcmpl-fuzz", "event_id": "fb-fuzz", "source": "user", "score": 1.0, "comment": "ok",
          "key": "correctness", "time": 1.7e9,
          "correction": {"role": "assistant", "content": "x", "name": "n", "tool_call_id": None, "tool_calls": [
              {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}
RECORD_PATHS = [(), ("interaction_id",), ("event_id",), ("source",), ("score",), ("comment",), ("key",), ("time",),
                ("correction",), ("correction", "role"), ("correction", "content"), ("correction", "name"),
                ("correction", "tool_call_id"), ("correction", "tool_calls"), ("correction", "tool_calls", 0),
                ("correction", "tool_calls", 0, "id"), ("correction", "tool_calls", 0, "type"),
                ("correction", "tool_calls", 0, "function"), ("correction", "tool_calls", 0, "function", "name"),
                ("correction", "tool_calls", 0, "function", "arguments"), ("schema_version",), ("tenant",),
                ("structured_outputs",)]


def body_and_paths(path: str) -> tuple[dict, list[tuple]]:
    """A valid body for `path` and the places in it to put odd values."""
    if path == "/v1/feedback":
        return RECORD, RECORD_PATHS
    batch = {"records": [RECORD, {"interaction_id": "chatcmpl-fuzz-2", "score": -1}]}
    return batch, [(), ("records",), ("records", 1), ("extra",)] + [("records", 0) + p for p in RECORD_PATHS]


@pytest.fixture
def door(webhook, registry):
    """(client, valid request, error log): one keep-alive connection to the webhook, and a
    valid feedback record sent on it with a plain tenant's key."""
    key = registry.create_tenant(f"fuzz-{uuid.uuid4().hex[:8]}")[1]

    def valid():
        return client.post("/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                           json={"interaction_id": f"ok-{uuid.uuid4().hex}", "score": 1.0})

    with keepalive_client(webhook.url) as client, server_errors() as log:
        client.key = key
        yield client, valid, log


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
@pytest.mark.parametrize("with_key", [True, False])
def test_schemathesis_requests_never_5xx_and_keep_the_connection(webhook, door, path, mode, with_key):
    client, valid, log = door
    schema = schemathesis.openapi.from_url(f"{webhook.url}/openapi.json")
    headers = {"Authorization": f"Bearer {client.key}"} if with_key else {}
    seen: set[int] = set()

    @fuzz_settings(40 if with_key else 10)
    @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
    def run(case):
        seen.add(send_case(client, case, valid, headers=headers, log=log).status_code)

    run()
    assert seen, "no request was sent"
    if mode == schemathesis.GenerationMode.POSITIVE:
        if with_key:
            assert 202 in seen, f"fuzzing never produced a valid record: {seen}"
        else:
            assert seen <= {401, 413}, f"a schema-valid request without a key was answered {seen}"


@pytest.mark.parametrize("path", PATHS)
def test_odd_values_in_any_field_never_5xx(door, path):
    client, valid, log = door
    body, places = body_and_paths(path)
    headers = {"Authorization": f"Bearer {client.key}", "Content-Type": "application/json"}

    @fuzz_settings(60)
    @given(change=mutations(places))
    def run(change):
        assert_door_holds(client, "POST", path, valid, content=dumps(change.apply(body)), headers=headers, log=log)

    run()


@pytest.mark.parametrize("path", PATHS)
def test_odd_bodies_never_5xx(door, path):
    client, valid, log = door
    headers = {"Authorization": f"Bearer {client.key}", "Content-Type": "application/json"}

    @fuzz_settings(30)
    @given(content=odd_bodies())
    def run(content):
        assert_door_holds(client, "POST", path, valid, content=content, headers=headers, log=log)

    run()


@pytest.mark.parametrize("header", ["Authorization", "X-Api-Key"])
def test_odd_api_key_headers_answer_401(door, header):
    client, valid, log = door

    @fuzz_settings(40)
    @given(value=header_values())
    def run(value):
        r = assert_door_holds(client, "POST", "/v1/feedback", valid, content=dumps(RECORD),
                              headers={header: value, "Content-Type": "application/json"}, log=log)
        assert r.status_code == 401, (value, r.status_code, r.text)

    run()


def test_odd_signature_headers_answer_401(door, registry):
    """A tenant that signs its feedback: odd X-Clora-Timestamp / X-Clora-Signature values (NaN
    and ±Infinity timestamps, non-ASCII signatures) are refused, never a 5xx."""
    client, valid, log = door
    tenant = f"fuzz-signed-{uuid.uuid4().hex[:8]}"
    key = registry.create_tenant(tenant)[1]
    secret = "s3cret"
    registry.set_signing_secret(tenant, secret)
    body = dumps(RECORD)
    now = lambda: str(int(time.time())).encode()   # noqa: E731
    timestamps = st.sampled_from(ODD_TIMESTAMPS) | st.builds(now) | header_values()
    signatures = (st.sampled_from(ODD_SIGNATURES) | header_values()
                  | st.builds(lambda: ("sha256=" + sign(secret, now().decode(), body + b" ")).encode()))

    @fuzz_settings(60)
    @given(ts=st.none() | timestamps, sig=st.none() | signatures)
    def run(ts, sig):
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        headers.update({k: v for k, v in (("X-Clora-Timestamp", ts), ("X-Clora-Signature", sig)) if v is not None})
        r = assert_door_holds(client, "POST", "/v1/feedback", valid, content=body, headers=headers, log=log)
        assert r.status_code == 401, (ts, sig, r.status_code, r.text)

    run()

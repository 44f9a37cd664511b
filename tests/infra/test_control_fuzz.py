"""Fuzz the control API (`/api/...`, with the real broker and Redis behind it): whatever the
path ids, query values or bodies an admin sends, it never answers 5xx and the keep-alive
connection stays usable (`tests.fuzz.assert_door_holds`).

Two sources of requests: schemathesis, from the control app's own /openapi.json (every
operation, with random ids and with an existing tenant's id), and hypothesis strategies for
odd values (`tests.fuzz`) in the path ids, the query counts and each field of the bodies.
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import (ODD_IDS, Raw, assert_door_holds, dumps, fuzz_settings, header_values, keepalive_client,
                        mutations, odd_bodies, odd_values, send_case, server_errors)

pytestmark = pytest.mark.integration

OPERATIONS = [
    ("GET", "/api/tenants"), ("POST", "/api/tenants"), ("GET", "/api/tenants/{tenant_id}"),
    ("PATCH", "/api/tenants/{tenant_id}/policy"), ("POST", "/api/tenants/{tenant_id}/pause"),
    ("POST", "/api/tenants/{tenant_id}/resume"), ("POST", "/api/tenants/{tenant_id}/keys"),
    ("POST", "/api/tenants/{tenant_id}/keys/rotate"), ("DELETE", "/api/tenants/{tenant_id}/keys/{key_id}"),
    ("GET", "/api/tenants/{tenant_id}/versions"), ("POST", "/api/tenants/{tenant_id}/versions/{version}/promote"),
    ("POST", "/api/tenants/{tenant_id}/rollback"), ("GET", "/api/tenants/{tenant_id}/buffers"),
    ("GET", "/api/tenants/{tenant_id}/feedback"), ("GET", "/api/tenants/{tenant_id}/metrics"),
    ("GET", "/api/tenants/{tenant_id}/traffic"), ("GET", "/api/dlq"), ("POST", "/api/dlq/{event_id}/replay"),
    ("GET", "/api/platform/events"), ("GET", "/api/tenants/{tenant_id}/freshness"),
    ("POST", "/api/tenants/{tenant_id}/tinker-keys"), ("GET", "/api/tenants/{tenant_id}/tinker-keys"),
    ("DELETE", "/api/tenants/{tenant_id}/tinker-keys/{key_id}"), ("GET", "/api/engine"),
    ("DELETE", "/api/tenants/{tenant_id}"),
]
"""Every operation of the control API's schema (`test_every_operation_is_fuzzed` keeps the list whole)."""


def DELETES_TENANT(method: str, path: str) -> bool:   # noqa: N802 - read as a constant predicate
    """The operation that would delete the fixture's tenant, which every other case reads: fuzzed
    with random ids only."""
    return (method, path) == ("DELETE", "/api/tenants/{tenant_id}")

POLICY_FIELDS = ["paused", "algorithm", "learning_rate", "batch_size", "weight", "priority", "min_new_examples",
                 "buffer_capacity", "eval_tolerance", "fresh_fraction", "reward_guard", "reward_guard_min_samples",
                 "reward_guard_margin", "reward_spec", "unpaired", "kto_beta", "kto_desirable_weight",
                 "kto_undesirable_weight", "sft_weight", "dpo_weight", "pg_weight", "kto_weight", "desirable_reward",
                 "reward_baseline_momentum", "paused_reason", "drift_tolerance", "hacking_guard",
                 "hacking_guard_min_replies", "hacking_guard_empty_rise", "hacking_guard_bad_tool_call_rise",
                 "hacking_guard_length_factor", "hacking_guard_diversity_fraction"]
ODD_KEYS = ["tenant_id", "self", "", "__class__", "paused ", "PAUSED", "a\x00b", "\ud800", "model_config", "id",
            "x" * 1000, "structured_outputs"]
"""Body keys a policy edit must refuse: the names of `update_policy`'s own parameters among them."""


@pytest.fixture
def door(console, registry):
    """(client, valid request, error log, tenant id): one keep-alive connection to the control
    API with the admin token, and a valid read of an existing tenant sent on it."""
    tenant = f"fuzz-{uuid.uuid4().hex[:8]}"
    registry.create_tenant(tenant)

    def valid():
        return client.get(f"/api/tenants/{tenant}")

    with keepalive_client(console.url) as client, server_errors() as log:
        client.headers["Authorization"] = f"Bearer {console.token}"
        yield client, valid, log, tenant


def test_every_operation_is_fuzzed(console):
    schema = schemathesis.openapi.from_url(f"{console.url}/openapi.json")
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == set(OPERATIONS)


def test_every_policy_field_is_fuzzed():
    from clora.registry import LearningPolicy

    assert sorted(POLICY_FIELDS) == sorted(LearningPolicy.model_fields)


@pytest.mark.parametrize("method, path, ids", [(m, p, ids) for m, p in OPERATIONS
                                               for ids in ("random", "existing tenant")
                                               if ids == "random" or ("{tenant_id}" in p and not DELETES_TENANT(m, p))])
def test_schemathesis_requests_never_5xx_and_keep_the_connection(console, door, method, path, ids):
    client, valid, log, tenant = door
    schema = schemathesis.openapi.from_url(f"{console.url}/openapi.json")
    fixed = {"tenant_id": tenant} if ids == "existing tenant" else None
    operation = schema[path][method]
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode, path_parameters=fixed)
                           for mode in schemathesis.GenerationMode))

    @fuzz_settings(30)
    @given(case=strategy)
    def run(case):
        send_case(client, case, valid, headers={"Authorization": f"Bearer {console.token}"}, log=log)

    run()


def _odd_path_id(s: str) -> str:
    return quote(s, safe="", errors="surrogatepass")


@pytest.mark.parametrize("method, path", [op for op in OPERATIONS if "{" in op[1]])
def test_odd_ids_in_the_path_never_5xx(door, method, path):
    """Ids with a trailing newline, ':', '/', NUL, surrogates (percent-encoded), nothing or far
    too much, in each path parameter; the others name an existing tenant."""
    client, valid, log, tenant = door
    ids = st.sampled_from(ODD_IDS) | st.text(max_size=30) | st.sampled_from(["1" + "0" * 30, "-1", "1e3", "NaN"])

    @fuzz_settings(40)
    @given(odd=ids, which=st.sampled_from([n for n in ("tenant_id", "key_id", "version", "event_id")
                                           if "{" + n + "}" in path]))
    def run(odd, which):
        values = {"tenant_id": tenant, "key_id": "k", "version": "1", "event_id": "e", which: odd}
        url = path.format(**{k: _odd_path_id(v) for k, v in values.items()})
        assert_door_holds(client, method, url, valid, content=b"{}", headers={"Content-Type": "application/json"},
                          log=log)

    run()


@pytest.mark.parametrize("path", ["/api/dlq", "/api/platform/events", "/api/tenants/{tenant_id}/buffers", "/api/tenants/{tenant_id}/feedback",
                                  "/api/tenants/{tenant_id}/metrics", "/api/tenants/{tenant_id}/traffic"])
def test_odd_query_counts_never_5xx(door, path):
    client, valid, log, tenant = door
    counts = (st.sampled_from(["1" + "0" * 400, "-" + "9" * 5000, "NaN", "inf", "1e9", "", "٣", "1\n", "0x10",
                               "9223372036854775808", "-9223372036854775809"])
              | st.integers().map(str) | st.text(max_size=10))

    @fuzz_settings(30)
    @given(n=counts)
    def run(n):
        name = "minutes" if path.endswith("traffic") else "n"
        assert_door_holds(client, "GET", path.format(tenant_id=tenant), valid, params={name: n}, log=log)

    run()


def test_odd_policy_edits_never_5xx(door):
    client, valid, log, tenant = door
    changes = st.one_of(
        st.builds(lambda k, v: {k: v}, st.sampled_from(POLICY_FIELDS + ODD_KEYS), odd_values()),
        st.builds(lambda k: {k: True}, st.sampled_from(ODD_KEYS) | st.text(max_size=20)),
        odd_values())

    @fuzz_settings(60)
    @given(change=changes)
    def run(change):
        assert_door_holds(client, "PATCH", f"/api/tenants/{tenant}/policy", valid, content=dumps(change),
                          headers={"Content-Type": "application/json"}, log=log)

    run()


NEW_TENANT = {"id": "fuzz-new", "name": "Fuzz", "policy": {"algorithm": "sft", "batch_size": 4},
              "init_adapter": None}
NEW_TENANT_PATHS = [(), ("id",), ("name",), ("policy",), ("policy", "algorithm"), ("policy", "batch_size"),
                    ("policy", "learning_rate"), ("policy", "tenant_id"), ("init_adapter",), ("signing_secret",),
                    ("extra",)]


def test_odd_new_tenants_never_5xx(door):
    """Odd values in each field of a new tenant (its id fresh per example, unless that is the
    field being fuzzed)."""
    client, valid, log, _ = door

    @fuzz_settings(60)
    @given(change=mutations(NEW_TENANT_PATHS), suffix=st.uuids())
    def run(change, suffix):
        body = {**NEW_TENANT, "id": f"fuzz-{suffix.hex[:10]}"}
        assert_door_holds(client, "POST", "/api/tenants", valid, content=dumps(change.apply(body)),
                          headers={"Content-Type": "application/json"}, log=log)

    run()


def test_odd_rollbacks_and_bodies_never_5xx(door):
    client, valid, log, tenant = door
    bodies = st.one_of(odd_values().map(lambda v: dumps({"version": v})), odd_bodies(),
                       st.just(dumps({"version": Raw("1" + "0" * 30)})))

    @fuzz_settings(40)
    @given(content=bodies, path=st.sampled_from(["rollback", "policy"]))
    def run(content, path):
        method = "PATCH" if path == "policy" else "POST"
        assert_door_holds(client, method, f"/api/tenants/{tenant}/{path}", valid, content=content,
                          headers={"Content-Type": "application/json"}, log=log)

    run()


def test_odd_admin_tokens_answer_401(door):
    client, valid, log, tenant = door

    @fuzz_settings(40)
    @given(value=header_values())
    def run(value):
        r = assert_door_holds(client, "GET", f"/api/tenants/{tenant}", valid, headers={"Authorization": value},
                              log=log)
        assert r.status_code == 401, (value, r.status_code, r.text)

    run()

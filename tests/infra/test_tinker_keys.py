"""Tinker keys (the training API's, `tml-...`) issued to tenants: by the control API (admin only,
shown once, listed by id, revoked) and by `clora tinker-key` through that API (over the real Redis). An unknown
tenant or key, or no admin token, is a 4xx naming the field in clora's error shape, and changes
nothing."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.integration


def admin(console) -> dict[str, str]:
    return {"Authorization": f"Bearer {console.token}"}


def test_the_control_api_issues_a_tinker_key_once_lists_it_and_revokes_it(console, registry, tenant_id):
    _, api_key = registry.create_tenant(tenant_id)
    url = f"{console.url}/api/tenants/{tenant_id}/tinker-keys"
    r = httpx.post(url, headers=admin(console))
    assert r.status_code == 201, r.text
    key, key_id = r.json()["tinker_key"], r.json()["key_id"]
    assert key.startswith("tml-") and registry.authenticate_tinker(key).model_dump() == {"tenant": tenant_id,
                                                                                          "key_id": key_id}
    assert registry.authenticate(key) is None and registry.authenticate_tinker(api_key) is None  # apart
    listed = httpx.get(url, headers=admin(console))
    assert [(k["key_id"], k["revoked_at"]) for k in listed.json()["tinker_keys"]] == [(key_id, None)]
    for shown in (listed.text, httpx.get(f"{console.url}/api/tenants/{tenant_id}", headers=admin(console)).text):
        assert key not in shown and key.split("_", 1)[1] not in shown      # stored hashed, shown once
    second = httpx.post(url, headers=admin(console)).json()["tinker_key"]
    assert httpx.delete(f"{url}/{key_id}", headers=admin(console)).json() == {"revoked": key_id}
    assert registry.authenticate_tinker(key) is None
    assert registry.authenticate_tinker(second).tenant == tenant_id     # the other key still works
    states = {k["key_id"]: k["revoked_at"] for k in httpx.get(url, headers=admin(console)).json()["tinker_keys"]}
    assert states[key_id] is not None and len(states) == 2


def error(r: httpx.Response, status: int, field: str) -> dict:
    assert r.status_code == status and r.json()["error"]["field"] == field, r.text
    return r.json()["error"]


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_tinker_keys_of_an_unknown_or_impossible_tenant_are_404_naming_tenant_id(console, tenant_id, method):
    for tenant in (tenant_id, "Not A Tenant", "acme:tinker_keys", "x" * 300):
        r = httpx.request(method, f"{console.url}/api/tenants/{tenant}/tinker-keys", headers=admin(console))
        assert error(r, 404, "tenant_id")["code"] == "tenant_not_found"


def test_revoking_an_unknown_tinker_key_is_404_naming_key_id_and_changes_nothing(console, registry, tenant_id):
    registry.create_tenant(tenant_id)
    key = registry.create_tinker_key(tenant_id)
    api_key_id = registry.list_keys(tenant_id)[0].key_id          # a tenant API key's id is no Tinker key's
    for key_id in ("nope", api_key_id):
        r = httpx.delete(f"{console.url}/api/tenants/{tenant_id}/tinker-keys/{key_id}", headers=admin(console))
        assert error(r, 404, "key_id")["code"] == "key_not_found"
    r = httpx.delete(f"{console.url}/api/tenants/{tenant_id}x/tinker-keys/{registry.authenticate_tinker(key).key_id}",
                     headers=admin(console))
    error(r, 404, "tenant_id")
    assert registry.authenticate_tinker(key).tenant == tenant_id and registry.list_keys(tenant_id)[0].revoked_at is None


@pytest.mark.parametrize("method, path", [("POST", "/tinker-keys"), ("GET", "/tinker-keys"),
                                          ("DELETE", "/tinker-keys/k")])
def test_tinker_key_routes_need_the_admin_token_and_name_the_authorization_header(console, registry, tenant_id,
                                                                                  method, path):
    _, api_key = registry.create_tenant(tenant_id)
    tinker_key = registry.create_tinker_key(tenant_id)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {api_key}"},
                    {"Authorization": f"Bearer {tinker_key}"}, {"X-API-Key": tinker_key}):
        r = httpx.request(method, f"{console.url}/api/tenants/{tenant_id}{path}", headers=headers)
        assert error(r, 401, "Authorization")["code"] == "admin_token_required"
    assert len(registry.list_tinker_keys(tenant_id)) == 1 and registry.authenticate_tinker(tinker_key) is not None


@pytest.fixture
def clora(stack, console, monkeypatch, tmp_path):
    """Run `clora ...` in process against the suite's control API (over its Redis); returns
    (exit code, output on one line)."""
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_REDIS_URL", stack.redis_url)
    monkeypatch.setenv("CLORA_CONTROL_URL", console.url)
    monkeypatch.setenv("CLORA_CONTROL_TOKEN", console.token)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
        return r.exit_code, " ".join(r.output.split())   # rich wraps long lines
    return run


def test_the_cli_issues_lists_and_revokes_tinker_keys(clora, registry, tenant_id):
    registry.create_tenant(tenant_id)
    code, said = clora("tinker-key", "create", "--tenant", tenant_id, "--json")
    assert code == 0, said
    issued = json.loads(said)
    assert issued["tenant"] == tenant_id and issued["tinker_key"].startswith("tml-")
    assert registry.authenticate_tinker(issued["tinker_key"]).key_id == issued["key_id"]
    code, said = clora("tinker-key", "create", "--tenant", tenant_id)
    assert code == 0 and said.startswith("Tinker key ") and f"for {tenant_id} (shown once): tml-" in said, said
    second = said.rsplit(" ", 1)[1]
    assert registry.authenticate_tinker(second).tenant == tenant_id
    code, said = clora("tinker-key", "list", "--tenant", tenant_id, "--json")
    assert code == 0 and {k["key_id"] for k in json.loads(said)["tinker_keys"]} == \
        {issued["key_id"], registry.authenticate_tinker(second).key_id}
    assert issued["tinker_key"] not in said and second not in said
    code, said = clora("tinker-key", "revoke", "--tenant", tenant_id, issued["key_id"])
    assert code == 0 and said == f"Tinker key {issued['key_id']} of {tenant_id} revoked"
    assert registry.authenticate_tinker(issued["tinker_key"]) is None
    code, said = clora("tinker-key", "list", "--tenant", tenant_id)
    assert code == 0 and "revoked" in said and "active" in said, said


@pytest.mark.parametrize("args, exit_code, says", [
    (["create", "--tenant", "{t}-nobody"], 3, "no tenant '{t}-nobody'"),
    (["list", "--tenant", "{t}-nobody"], 3, "no tenant '{t}-nobody'"),
    (["create", "--tenant", "Bad Id"], 3, "no tenant 'Bad Id'"),
    (["revoke", "--tenant", "{t}", "nope"], 3, "'nope'"),
    (["create"], 2, "Missing option '--tenant'"),
])
def test_the_cli_refuses_an_unknown_tenant_or_key_naming_it(clora, registry, tenant_id, args, exit_code, says):
    """Not found exits 3 (usage 2), with one line naming what was not found."""
    registry.create_tenant(tenant_id)
    code, said = clora("tinker-key", *[a.format(t=tenant_id) for a in args])
    assert code == exit_code and says.format(t=tenant_id) in said, said
    assert registry.list_tinker_keys(tenant_id) == []

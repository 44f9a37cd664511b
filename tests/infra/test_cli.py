"""`clora tenant create` in process (typer's runner) against the real control API: the adapter a
tenant starts from (a relative path is resolved where the command runs), and the error a bad one
gets (exit 4, refused by the server, naming the field)."""

from __future__ import annotations

import json

import pytest

from clora.registry import ADAPTER_FILES, TenantNotFound

pytestmark = pytest.mark.integration


def test_cli_tenant_create_with_an_adapter(console, registry, tenant_id, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_CONTROL_URL", console.url)
    monkeypatch.setenv("CLORA_CONTROL_TOKEN", console.token)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-lora").mkdir()
    for f in ADAPTER_FILES:
        (tmp_path / "my-lora" / f).write_text("{}")
    runner = CliRunner()
    ok = runner.invoke(app, ["tenant", "create", tenant_id, "--adapter", "./my-lora", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["init_adapter"] == str(tmp_path / "my-lora")
    assert registry.get_tenant(tenant_id).init_adapter == str(tmp_path / "my-lora")
    bad = runner.invoke(app, ["tenant", "create", tenant_id + "-b", "--adapter", "./nowhere"])
    said = " ".join(bad.output.split())  # rich wraps long lines
    assert bad.exit_code == 4 and said.startswith("error: init_adapter: ")
    assert said.endswith("nowhere is not a directory")
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id + "-b")

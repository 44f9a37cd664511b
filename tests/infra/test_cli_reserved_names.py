"""`clora tenant create` refuses a reserved name (the base model's), saying why (exit 4: the
control API refused it)."""

from __future__ import annotations

import pytest

from clora.registry import TenantNotFound

pytestmark = pytest.mark.integration


def test_cli_refuses_to_create_a_tenant_named_like_the_base_model(console, registry, monkeypatch):
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_CONTROL_URL", console.url)
    monkeypatch.setenv("CLORA_CONTROL_TOKEN", console.token)
    r = CliRunner().invoke(app, ["tenant", "create", "base"])
    said = " ".join(r.output.split())
    assert r.exit_code == 4 and said.startswith("error: id: 'base' is reserved"), r.output
    with pytest.raises(TenantNotFound):
        registry.get_tenant("base")

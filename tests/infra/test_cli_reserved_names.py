"""`clora tenant create` refuses a reserved name (the base model's), saying why."""

from __future__ import annotations

import pytest

from clora.registry import TenantNotFound

pytestmark = pytest.mark.integration


def test_cli_refuses_to_create_a_tenant_named_like_the_base_model(stack, registry, monkeypatch):
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_REDIS_URL", stack.redis_url)
    r = CliRunner().invoke(app, ["tenant", "create", "base"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and said.startswith("error: id: 'base' is reserved"), r.output
    with pytest.raises(TenantNotFound):
        registry.get_tenant("base")

"""`clora tenant policy` in process (typer's runner) against the real control API: it shows a
tenant's reward spec, sets one (inline or from a file), and a bad one exits naming the field
without changing anything: 4 when the control API refused it, 2 when the command line could not
read it."""

from __future__ import annotations

import json

import pytest

from clora.registry import LearningPolicy
from clora.ingest.buffers import PendingWrite, ReplayBuffer

pytestmark = pytest.mark.integration

SPEC = {"keys": {"thumbs": {"type": "bool", "sources": ["user"]},
                 "stars": {"type": "scale", "lo": 1, "hi": 5, "weight": 0.5, "sources": ["user", "operator"]}}}


@pytest.fixture
def clora(console, monkeypatch, tmp_path):
    """Run `clora ...` against the test console; returns (exit code, output on one line)."""
    from typer.testing import CliRunner

    from clora.infra.cli import app

    monkeypatch.setenv("CLORA_CONSOLE_PORT", str(console.port))
    monkeypatch.setenv("CLORA_ADMIN_TOKEN", console.token)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(app, list(args))
        return r.exit_code, " ".join(r.output.split())   # rich wraps long lines
    return run


def test_cli_sets_and_shows_a_reward_spec(clora, registry, redis_client, tenant_id, tmp_path):
    registry.create_tenant(tenant_id)
    code, said = clora("tenant", "policy", tenant_id)
    assert code == 0 and "reward spec: none (every score trains as its own reward" in said, said
    code, said = clora("tenant", "policy", tenant_id, "--reward-spec", json.dumps(SPEC))
    assert code == 0, said
    assert "stars" in said and "1 – 5" in said and "user, operator" in said
    assert registry.get_tenant(tenant_id).policy.reward_spec.keys["stars"].weight == 0.5
    ReplayBuffer(redis_client).add_many(tenant_id, [PendingWrite(f"fb{i}", [], "", untrained="unknown_key")
                                                    for i in range(2)], now=1.0)
    code, said = clora("tenant", "policy", tenant_id)
    assert code == 0 and said.endswith("untrained feedback: unknown_key 2"), said
    (tmp_path / "spec.json").write_text(json.dumps({"keys": {"latency": {
        "type": "scalar", "lo": 0, "hi": 500, "invert": True, "sources": ["environment"]}}}))
    code, said = clora("tenant", "policy", tenant_id, "--reward-spec", "@spec.json", "--json")
    assert code == 0, said
    assert list(json.loads(said)["policy"]["reward_spec"]["keys"]) == ["latency"]
    code, said = clora("tenant", "policy", tenant_id, "--reward-spec", "none")
    assert code == 0 and registry.get_tenant(tenant_id).policy.reward_spec is None


@pytest.mark.parametrize("spec, exit_code, says", [
    (json.dumps({"keys": {"stars": {"type": "scale", "lo": 5, "hi": 1, "sources": ["user"]}}}), 4,
     "error: reward_spec.keys.stars.hi: Value error, hi (1) must be above lo (5)"),
    (json.dumps({"keys": {"Stars!": {"type": "bool", "sources": ["user"]}}}), 4,
     "error: reward_spec.keys.Stars!.[key]: String should match pattern '^[a-z0-9][a-z0-9_.-]{0,63}$'"),
    (json.dumps({"keys": {"t": {"type": "bool", "sources": ["crowd"]}}}), 4, "error: reward_spec.keys.t.sources.0: "),
    ('{"keys": {', 2, "error: --reward-spec is not JSON: "),
    ("[1, 2]", 2, "error: --reward-spec must be a JSON object"),
    ("@nowhere.json", 2, "error: --reward-spec: cannot read nowhere.json"),
])
def test_cli_refuses_a_bad_reward_spec_naming_the_field(clora, registry, tenant_id, spec, exit_code, says):
    registry.create_tenant(tenant_id)
    code, said = clora("tenant", "policy", tenant_id, "--reward-spec", spec)
    assert code == exit_code and said.startswith(says), said
    assert registry.get_tenant(tenant_id).policy == LearningPolicy()


def test_cli_policy_of_an_unknown_tenant_exits_3(clora, tenant_id):
    code, said = clora("tenant", "policy", tenant_id)
    assert code == 3 and said.startswith("error: no tenant"), said

"""The demo's scoring against the fake OpenAI server (the whole demo runs as users run it)."""

import json

from rich.console import Console

from clora.agents.runtime import Agent
from clora.agents.simulate import HeldOutScores
import pytest

from clora.infra.demo import TENANTS, Demo, pick_tenants


def test_the_final_evaluation_scores_the_pinned_versions(fake_openai, openai_client):
    demo = Demo(minutes=1, eval_size=3, console=Console(quiet=True))
    agents = {t.id: Agent(openai_client, t.id, tools=t.env.tools, max_turns=3) for t in TENANTS}
    pinned = {"calc": 7, "support": None, "extract": 2, "greet": 3}
    scores = demo._score_all(agents, pinned=pinned)
    assert scores == {t: HeldOutScores(0.0, 0.0) for t in ("calc", "support", "extract", "greet")}
    # a version published during the evaluation is never served to it: every request names its version
    assert {r["model"] for r in fake_openai.requests} == {"calc@v7", "support", "extract@v2", "greet@v3"}
    assert all(r["temperature"] == 0.0 for r in fake_openai.requests)
    # 3 same-template + 3 unseen problems each, one call each ("I don't know." ends it)
    assert len(fake_openai.requests) == len(TENANTS) * (3 + 3)
    asked = {r["messages"][1]["content"] for r in fake_openai.requests}
    assert asked == {p.key for t in TENANTS for family in ("same", "unseen") for p in t.env.held_out(family)[:3]}
    fake_openai.requests.clear()
    demo._score_all(agents, base=True)
    # the base evaluation (the unit of FINAL_EVAL_RESERVE) makes the same passes as the final one
    assert {r["model"] for r in fake_openai.requests} == {"base"} and len(fake_openai.requests) == len(TENANTS) * 6


def test_the_report_puts_same_template_and_unseen_scores_side_by_side(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    console = Console(record=True, width=200)
    demo = Demo(minutes=1, eval_size=3, console=console)
    demo.progress["calc"].base, demo.progress["calc"].final = HeldOutScores(0.1, 0.05), HeldOutScores(1.0, 0.35)
    demo.progress["calc"].score_version = 4
    demo.progress["calc"].freshness_p50 = 41.6
    demo.progress["support"].base = HeldOutScores(0.0, 0.0)         # never finished its final evaluation
    phases = {"startup_s": 1.0, "base_eval_s": 2.0, "learning_s": 3.0, "final_eval_s": 4.0, "total_s": 10.0}
    result = demo._report(phases)

    written = json.loads((tmp_path / "bench-results" / "demo.json").read_text())
    assert written == json.loads(json.dumps(result))
    calc, support = written["tenants"][0], written["tenants"][1]
    assert (calc["base_score"], calc["base_unseen_score"], calc["score"], calc["unseen_score"]) == \
        (0.1, 0.05, 1.0, 0.35)
    assert calc["score_version"] == 4 and calc["freshness_p50"] == 41.6 and support["freshness_p50"] is None
    assert (support["base_score"], support["base_unseen_score"], support["score"], support["unseen_score"]) == \
        (0.0, 0.0, None, None)
    text = console.export_text()
    assert "held-out score, base model vs final adapter" in text
    assert all(col in text for col in ("base same", "base unseen", "final same", "final unseen"))
    calc_line = next(line for line in text.splitlines() if line.strip("│ ").startswith("calc"))
    assert [c.strip() for c in calc_line.split("│")[3:8]] == ["0.10", "0.05", "1.00", "0.35", "v4"]
    assert calc_line.split("│")[-2].strip() == "42 s"                  # feedback -> served p50


def test_the_demo_runs_the_tenants_named_and_refuses_unknown_ones():
    assert pick_tenants(None) == pick_tenants("") == TENANTS
    assert [t.id for t in pick_tenants("greet, calc,greet")] == ["greet", "calc"]
    shop = pick_tenants("calc,shop")[1]                        # retail only when named
    assert shop.env.name == "retail" and "shop" not in {t.id for t in TENANTS}
    assert (shop.max_turns, shop.max_tokens) == (10, 64) and shop.feedback == "corrections"
    with pytest.raises(ValueError, match="unknown demo tenant.*nope.*choose from calc, support, extract, greet"):
        pick_tenants("calc,nope")
    greet = next(t for t in TENANTS if t.id == "greet")
    # the thumbs tenant trusts only users' thumbs, and nothing but its thumbs reach it
    assert greet.feedback == "thumbs" and greet.policy["algorithm"] == "auto"
    assert greet.policy["reward_spec"] == {"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}}
    assert all(t.feedback == "corrections" for t in TENANTS if t.id != "greet")

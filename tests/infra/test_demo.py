"""The demo's scoring against the fake OpenAI server (the whole demo runs as users run it)."""

from rich.console import Console

from clora.infra.demo import TENANTS, Demo
from clora.agents.runtime import Agent


def test_the_final_evaluation_scores_the_pinned_versions(fake_openai, openai_client):
    demo = Demo(minutes=1, eval_size=3, console=Console(quiet=True))
    agents = {t.id: Agent(openai_client, t.id, tools=t.env.tools, max_turns=3) for t in TENANTS}
    pinned = {"calc": 7, "support": None, "extract": 2}
    scores = demo._score_all(agents, pinned=pinned)
    assert set(scores) == {"calc", "support", "extract"}
    # a version published during the evaluation is never served to it: every request names its version
    assert {r["model"] for r in fake_openai.requests} == {"calc@v7", "support", "extract@v2"}
    assert all(r["temperature"] == 0.0 for r in fake_openai.requests)
    assert len(fake_openai.requests) == 3 * 3          # 3 problems each, one call each ("I don't know." ends it)
    fake_openai.requests.clear()
    demo._score_all(agents, base=True)
    assert {r["model"] for r in fake_openai.requests} == {"base"}

"""The agent loop against a fake OpenAI-compatible server (unit tests; the real gateway is
exercised by the platform's end-to-end tests)."""

import asyncio

import openai
import pytest

from clora.agents.envs import ArithmeticEnv, SupportEnv
from clora.agents.runtime import SEED_SPAN, Agent, AgentError, AsyncAgent, call_seed
from clora.agents.tools import Calculator, FinalAnswer, ToolRegistry

from tests.fakes import oracle

TOOLS = ToolRegistry.of([Calculator, FinalAnswer])


def test_episode_calls_calculator_then_final_answer(fake_openai, openai_client):
    env = ArithmeticEnv()
    p = env.problem(1, "hard")
    fake_openai.policy = oracle(env, [p])
    trace = Agent(openai_client, "acme", TOOLS).run(list(p.messages))

    assert trace.stop == "final_answer" and trace.answer == str(p.expected)
    assert env.reward(p, trace.answer) == 1.0
    assert trace.interaction_ids == fake_openai.response_ids and len(set(trace.interaction_ids)) == 2
    assert [m["role"] for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert [t.message_index for t in trace.turns] == [2, 4]
    calc, final = trace.tool_calls
    assert (calc.name, calc.result, calc.error) == ("calculator", str(p.expected), False)
    assert (final.name, final.result) == ("final_answer", None)
    assert trace.prompt_of(trace.turns[1])[-1] == {"role": "tool", "tool_call_id": calc.id, "content": str(p.expected)}
    assert (trace.prompt_tokens, trace.completion_tokens, trace.total_tokens) == (20, 10, 30)
    first, second = fake_openai.requests
    assert first["model"] == "acme" and first["max_tokens"] == 64 and "n" not in first and "metadata" not in first
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator", "final_answer"]
    assert second["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert second["metadata"] == {"episode_id": trace.interaction_ids[0]}    # the episode it continues


def test_plain_reply_ends_the_episode_without_an_answer_when_a_final_tool_exists(fake_openai, openai_client):
    fake_openai.policy = lambda body, i: "It is 51."
    trace = Agent(openai_client, "acme", TOOLS).run([{"role": "user", "content": "17*3?"}])
    assert (trace.stop, trace.answer, len(trace.turns)) == ("reply", None, 1)
    assert trace.messages[-1] == {"role": "assistant", "content": "It is 51."}


def test_agent_without_tools_answers_with_its_reply(fake_openai, openai_client):
    env = SupportEnv()
    p = env.problem(2, "easy")
    fake_openai.policy = oracle(env, [p])
    trace = Agent(openai_client, "acme").run(list(p.messages))
    assert trace.stop == "reply" and env.reward(p, trace.answer) == 1.0
    assert "tools" not in fake_openai.requests[0]


def test_tool_errors_go_back_to_the_model_and_max_turns_stops_the_loop(fake_openai, openai_client):
    script = iter(['<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                   '<tool_call>{"name": "calculator", "arguments": {"expression": "os.system(1)"}}</tool_call>',
                   '<tool_call>{"name": "final_answer", "arguments": {"value": 3}}</tool_call>'])
    fake_openai.policy = lambda body, i: next(script)
    trace = Agent(openai_client, "acme", TOOLS, max_turns=3).run([{"role": "user", "content": "q"}])
    assert (trace.stop, trace.answer, len(trace.turns)) == ("max_turns", None, 3)
    results = [m["content"] for m in trace.messages if m["role"] == "tool"]
    assert results[0].startswith("error: unknown tool 'search'")
    assert "Call found in 'os.system(1)'" in results[1] and "arguments must be an object with 'answer'" in results[2]
    assert all(c.error for c in trace.tool_calls)


def test_group_rollouts_share_a_group_id_and_sample_the_first_turn_n_times(fake_openai, openai_client):
    env = ArithmeticEnv()
    p = env.problem(3, "easy")
    fake_openai.policy = oracle(env, [p])
    traces = Agent(openai_client, "acme", TOOLS).run_group(list(p.messages), 3, group_id="g-1")

    assert len(traces) == 3 and {t.group_id for t in traces} == {"g-1"}
    first = fake_openai.requests[0]
    assert first["n"] == 3 and first["metadata"] == {"group_id": "g-1"}
    assert len(fake_openai.requests) == 4  # one sampled turn for all, then one continuation each
    rid = fake_openai.response_ids[0]
    assert [t.interaction_ids[0] for t in traces] == [f"{rid}-0", f"{rid}-1", f"{rid}-2"]
    # each continuation names its episode: the first turn's interaction id
    assert sorted(r["metadata"]["episode_id"] for r in fake_openai.requests[1:]) == [f"{rid}-{i}" for i in range(3)]
    assert all(r["metadata"]["group_id"] == "g-1" for r in fake_openai.requests)
    assert all(env.reward(p, t.answer) == 1.0 for t in traces)
    assert len({iid for t in traces for iid in t.interaction_ids}) == 6


class _BarrierClient:
    """An OpenAI-shaped client whose continuation calls (n = 1) each wait at a barrier of
    `parties`: they all return only if that many are in flight at once."""

    def __init__(self, parties: int):
        import threading
        from types import SimpleNamespace as NS

        self._ns, self.barrier, self.calls = NS, threading.Barrier(parties, timeout=30), []
        self.chat = NS(completions=NS(create=self.create))

    def create(self, **kw):
        NS, n = self._ns, kw.get("n", 1)
        self.calls.append(n)
        if n == 1:
            self.barrier.wait()  # BrokenBarrierError if the branches ran one at a time
            content, calls = "done", None
        else:
            content, calls = None, [NS(id="c1", function=NS(name="calculator", arguments='{"expression": "1+1"}'))]
        choices = [NS(index=i, message=NS(content=content, tool_calls=calls), finish_reason="stop") for i in range(n)]
        return NS(id=f"r{len(self.calls)}", choices=choices, usage=NS(prompt_tokens=5, completion_tokens=n))


def test_sync_agent_continues_group_branches_concurrently():
    client = _BarrierClient(parties=3)
    traces = Agent(client, "acme", TOOLS).run_group([{"role": "user", "content": "q"}], 3, group_id="g-2")
    assert client.calls == [3, 1, 1, 1]  # one sampled turn for all, then each branch's next turn at once
    assert [t.stop for t in traces] == ["reply"] * 3 and [len(t.turns) for t in traces] == [2, 2, 2]
    assert [t.interaction_ids[0] for t in traces] == ["r1-0", "r1-1", "r1-2"]  # traces keep the choices' order


def test_sync_agent_group_branch_failure_raises_with_context():
    client = _BarrierClient(parties=2)
    client.barrier.abort()  # every continuation fails
    with pytest.raises(AgentError, match=r"model 'acme': call 2 of the episode \(group g-3\) failed"):
        Agent(client, "acme", TOOLS).run_group([{"role": "user", "content": "q"}], 2, group_id="g-3")


def test_failed_model_call_raises_with_context(fake_openai, openai_client):
    fake_openai.fail_next = 1
    with pytest.raises(AgentError, match=r"model 'acme': call 1 of the episode \(group g-9\) failed") as e:
        Agent(openai_client, "acme", TOOLS).run([{"role": "user", "content": "q"}], group_id="g-9")
    assert isinstance(e.value.__cause__, openai.BadRequestError)


def test_async_agent_runs_group_branches_concurrently(fake_openai):
    env = ArithmeticEnv()
    problems = env.train_problems(2, seed=5)
    fake_openai.policy = oracle(env, problems)

    async def main():
        async with openai.AsyncOpenAI(base_url=fake_openai.url + "/v1", api_key="k", max_retries=0) as client:
            agent = AsyncAgent(client, "acme", TOOLS)
            return await asyncio.gather(*(agent.run_group(list(p.messages), 2) for p in problems))

    groups = asyncio.run(main())
    for p, traces in zip(problems, groups):
        assert [env.reward(p, t.answer) for t in traces] == [1.0, 1.0]
        assert traces[0].group_id == traces[1].group_id and traces[0].group_id.startswith("grp-")
    assert len({g[0].group_id for g in groups}) == 2


def test_max_turns_must_be_positive(openai_client):
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        Agent(openai_client, "acme", TOOLS, max_turns=0)


class _SeedClient:
    """An OpenAI-shaped client that answers every call alike except for the tool call ids it
    makes up, as a server does; it records each call's (n, seed)."""

    def __init__(self):
        import threading
        from types import SimpleNamespace as NS

        self._ns, self._lock, self.calls = NS, threading.Lock(), []
        self.chat = NS(completions=NS(create=self.create))

    def create(self, **kw):
        import uuid

        NS, n = self._ns, kw.get("n", 1)
        with self._lock:
            self.calls.append((n, kw.get("seed")))
        def message():
            if n == 1:
                return NS(content="done", tool_calls=None)
            return NS(content=None, tool_calls=[NS(id=uuid.uuid4().hex, function=NS(
                name="calculator", arguments='{"expression": "1+1"}'))])
        choices = [NS(index=i, message=message(), finish_reason="stop") for i in range(n)]
        return NS(id=uuid.uuid4().hex, choices=choices, usage=NS(prompt_tokens=5, completion_tokens=n))


def _seeds(**agent) -> list[tuple[int, int | None]]:
    client = _SeedClient()
    Agent(client, "acme", TOOLS, **agent).run_group([{"role": "user", "content": "q"}], 3)
    return client.calls


def test_a_seeded_agent_seeds_each_call_from_its_seed_branch_and_conversation_not_from_ids():
    first, again = _seeds(seed=3), _seeds(seed=3)
    assert first[0][0] == 3 and sorted(first) == sorted(again)      # the same calls, whatever order they ran in
    continuations = [s for n, s in first if n == 1]
    assert len(set(continuations)) == 3 and first[0][1] not in continuations   # each branch its own stream
    assert all(0 <= s < SEED_SPAN for _, s in first)
    assert not set(s for _, s in _seeds(seed=4)) & set(s for _, s in first)
    assert {s for _, s in _seeds()} == {None}                                  # unseeded: no seed sent
    assert {s for _, s in _seeds(seed=3, extra={"seed": 9})} == {9}            # an explicit one as it is


def test_call_seed_reads_what_was_said_not_the_ids():
    said = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a1", "content": "2"}]
    other_ids = [dict(m) for m in said]
    other_ids[1] = {**said[1], "tool_calls": [{**said[1]["tool_calls"][0], "id": "b2"}]}
    other_ids[2] = {**said[2], "tool_call_id": "b2"}
    assert call_seed(1, 0, said) == call_seed(1, 0, other_ids)
    assert len({call_seed(1, 0, said), call_seed(1, 1, said), call_seed(2, 0, said),
                call_seed(1, 0, said[:2] + [{**said[2], "content": "3"}])}) == 4

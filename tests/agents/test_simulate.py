"""Traffic and operator simulators against the fake OpenAI server and the fake webhook."""

import pytest

from clora.agents.envs import ArithmeticEnv, StructuredEnv, SupportEnv
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent, AgentError
from clora.agents.simulate import (HeldOutScores, OperatorSimulator, TenantTraffic, ThumbsUser, evaluate,
                                   evaluate_held_out, run_tenants, same_action)

from tests.fakes import oracle


@pytest.fixture
def feedback(fake_webhook):
    with FeedbackClient(fake_webhook.url, "key-1", sleep=lambda s: None) as c:
        yield c


def test_step_runs_groups_and_sends_each_turn_its_episode_reward(fake_openai, openai_client, feedback, fake_webhook):
    env = ArithmeticEnv()
    traffic = TenantTraffic("acme", Agent(openai_client, "acme", env.tools), env, feedback,
                            group_size=3, prompts_per_step=2, seed=1)
    fake_openai.policy = oracle(env, traffic.problems_for(0))
    report = traffic.step()

    assert (report.tenant, report.step, len(report.rollouts), report.errors) == ("acme", 0, 6, ())
    assert report.mean_reward == 1.0 and report.rewards_sent == 12 and report.corrections_sent == 0
    sent = fake_webhook.accepted
    turn_ids = [iid for r in report.rollouts for iid in r.trace.interaction_ids]
    assert sorted(r.interaction_id for r in sent) == sorted(turn_ids)
    assert {(r.source, r.score, r.key) for r in sent} == {("environment", 1.0, "arithmetic")}
    assert all(r.event_id == f"env-{r.interaction_id}" for r in sent)
    groups = {r.trace.group_id for r in report.rollouts}
    assert len(groups) == 2 and all(g.startswith("acme-") for g in groups)
    assert sorted(req["n"] for req in fake_openai.requests if "n" in req) == [3, 3]
    assert traffic.problems_for(0) == ArithmeticEnv().train_problems(2, seed=1_000_003) and traffic.steps_done == 1


def test_a_group_seed_names_each_step_s_groups_alike_in_every_traffic(fake_openai, openai_client, feedback):
    env = ArithmeticEnv()

    def groups(group_seed):
        traffic = TenantTraffic("acme", Agent(openai_client, "acme", env.tools), env, feedback, group_size=2,
                                prompts_per_step=2, seed=1, group_seed=group_seed)
        fake_openai.policy = oracle(env, traffic.problems_for(0) + traffic.problems_for(1))
        return [sorted({r.trace.group_id for r in traffic.step().rollouts}) for _ in range(2)]

    assert groups("run7-e3") == [["run7-e3-0-0", "run7-e3-0-1"], ["run7-e3-1-0", "run7-e3-1-1"]]
    assert groups("run7-e3") == groups("run7-e3")              # another traffic: the same names
    unseeded = groups(None)
    assert all(g.startswith("acme-") for step in unseeded for g in step) and unseeded != groups(None)


def test_operator_corrects_wrong_answers_with_the_reference(fake_openai, openai_client, feedback, fake_webhook):
    env = ArithmeticEnv()
    fake_openai.policy = lambda body, i: "The answer is 3."
    traffic = TenantTraffic("acme", Agent(openai_client, "acme", env.tools), env, feedback, group_size=2,
                            prompts_per_step=2, operator=OperatorSimulator(env, share=1.0))
    report = traffic.step()

    assert report.mean_reward == 0.0 and report.rewards_sent == 4 and report.corrections_sent == 4
    fixes = [r for r in fake_webhook.accepted if r.source == "operator"]
    by_iid = {iid: r for r in report.rollouts for iid in r.trace.interaction_ids}
    for fix in fixes:
        problem = by_iid[fix.interaction_id].problem
        call = fix.correction.tool_calls[0].function
        assert fix.event_id == f"op-{fix.interaction_id}" and fix.key == "correction"
        assert call.name == "calculator" and call.arguments == problem.reference[0]["tool_calls"][0]["function"][
            "arguments"]


def _support_rollout(env, p, iid, reply):
    from clora.agents.runtime import EpisodeTrace, Turn
    from clora.agents.simulate import Rollout

    trace = EpisodeTrace((*p.messages, {"role": "assistant", "content": reply}), (Turn(iid, 2, (), "stop", 1, 1),),
                         reply, "reply")
    return Rollout(p, trace, env.reward(p, reply))


def test_a_thumbs_user_rates_each_reply_by_the_bar_with_a_share_flipped():
    env = SupportEnv()
    p = env.problem(1, "easy")
    good = [_support_rollout(env, p, f"g-{k}", p.reference[0]["content"]) for k in range(400)]
    bad = [_support_rollout(env, p, f"b-{k}", "Sure.") for k in range(400)]
    user = ThumbsUser(noise=0.1, seed=7)
    ups_good = sum(rec.score for r in good for rec in user.thumbs(r))
    ups_bad = sum(rec.score for r in bad for rec in user.thumbs(r))
    assert 340 <= ups_good <= 380 and 20 <= ups_bad <= 60          # 360 and 40 expected: 10% flipped
    [rec] = user.thumbs(good[0])
    assert (rec.key, rec.source, rec.event_id, rec.correction) == ("thumbs", "user", "th-g-0", None)
    assert user.thumbs(good[0]) == ThumbsUser(noise=0.1, seed=7).thumbs(good[0])     # a resent step: same thumbs
    exact = ThumbsUser(noise=0.0)
    assert all(rec.score == 1.0 for r in good[:20] for rec in exact.thumbs(r))
    assert all(rec.score == 0.0 for r in bad[:20] for rec in exact.thumbs(r))
    partial = _support_rollout(env, p, "half", f"Hi {p.expected.name}, sorry.")      # one rule of three
    assert exact.thumbs(partial)[0].score == 0.0 and ThumbsUser(noise=0.0, bar=0.3).thumbs(partial)[0].score == 1.0
    with pytest.raises(ValueError, match="noise must be in"):
        ThumbsUser(noise=0.6)


def test_traffic_with_a_user_sends_thumbs_instead_of_rewards(fake_openai, openai_client, feedback, fake_webhook):
    env = SupportEnv()
    fake_openai.policy = lambda body, i: "Sure."
    traffic = TenantTraffic("acme", Agent(openai_client, "acme", env.tools), env, feedback, group_size=1,
                            prompts_per_step=4, user=ThumbsUser(noise=0.0))
    report = traffic.step()

    assert report.rewards_sent == 4 and report.corrections_sent == 0
    assert {(r.source, r.key, r.score) for r in fake_webhook.accepted} == {("user", "thumbs", 0.0)}
    # single replies, as production sends them: no group id, so the learner scores each alone
    assert all(r.trace.group_id is None for r in report.rollouts)
    assert not any("group_id" in (req.get("metadata") or {}) for req in fake_openai.requests)
    with pytest.raises(ValueError, match="group_size must be 1"):
        TenantTraffic("acme", Agent(openai_client, "acme", env.tools), env, feedback, group_size=2,
                      user=ThumbsUser())


def test_operator_share_and_right_turns_are_respected():
    env = SupportEnv()
    p = env.problem(1, "easy")
    from clora.agents.runtime import EpisodeTrace, Turn
    from clora.agents.simulate import Rollout

    def rollout(iid, reply):
        messages = (*p.messages, {"role": "assistant", "content": reply})
        trace = EpisodeTrace(messages, (Turn(iid, 2, (), "stop", 1, 1),), reply, "reply")
        return Rollout(p, trace, env.reward(p, reply))

    wrong = [rollout(f"i-{k}", "Sure.") for k in range(200)]
    assert sum(bool(OperatorSimulator(env, share=0.25, seed=3).review(r)) for r in wrong) in range(30, 71)
    assert not any(OperatorSimulator(env, share=0.0).review(r) for r in wrong)
    right = rollout("i-right", p.reference[0]["content"])
    assert OperatorSimulator(env, share=1.0).review(right) == []
    assert OperatorSimulator(env, share=1.0, only_wrong=False).review(right) == []  # already what it should be
    fix = OperatorSimulator(env, share=1.0).review(wrong[0])[0]
    assert fix.correction.content == p.reference[0]["content"] and fix.source == "operator"
    with pytest.raises(ValueError, match="share must be in"):
        OperatorSimulator(env, share=1.5)


def test_operator_corrects_the_first_wrong_turn_of_an_episode():
    from clora.agents.envs.arithmetic import calculator_call
    from clora.agents.runtime import EpisodeTrace, Turn
    from clora.agents.simulate import Rollout

    env = ArithmeticEnv()
    p = env.problem(5, "easy")
    call, result, final = p.reference
    wrong_call = calculator_call("1+1")

    def rollout(*replies):
        messages, turns = list(p.messages), []
        for k, (reply, tool_result) in enumerate(replies):
            turns.append(Turn(f"i-{k}", len(messages), (), "tool_calls", 1, 1))
            messages += [reply] + ([{"role": "tool", "tool_call_id": "call_calc", "content": tool_result}]
                                   if tool_result is not None else [])
        return Rollout(p, EpisodeTrace(tuple(messages), tuple(turns), None, "max_turns"), 0.0)

    derailed = rollout((wrong_call, "2"), (wrong_call, "2"))         # wrong, then a retry as wrong
    fixes = OperatorSimulator(env, share=1.0).review(derailed)
    assert [(f.interaction_id, f.correction.tool_calls[0].function.arguments) for f in fixes] == \
        [("i-0", call["tool_calls"][0]["function"]["arguments"])]
    assert [f.interaction_id for f in OperatorSimulator(env, share=1.0, every_turn=True).review(derailed)] == \
        ["i-0", "i-1"]
    # the right call, then another calculator call instead of final_answer: the second turn is the mistake
    stuck = rollout((call, result["content"]), (call, result["content"]))
    [fix] = OperatorSimulator(env, share=1.0).review(stuck)
    assert fix.interaction_id == "i-1" and fix.correction.tool_calls[0].function.name == "final_answer"
    assert fix.correction.tool_calls[0].function.arguments == final["tool_calls"][0]["function"]["arguments"]


def test_a_following_operator_corrects_the_later_turns_along_the_right_path(fake_openai, openai_client, feedback,
                                                                           fake_webhook):
    env = ArithmeticEnv()
    agent = Agent(openai_client, "acme", env.tools)
    traffic = TenantTraffic("acme", agent, env, feedback, group_size=2, prompts_per_step=2, seed=4,
                            operator=OperatorSimulator(env, share=1.0, follow=agent))
    problems = {p.key: p for p in traffic.problems_for(0)}
    right = oracle(env, problems.values())
    # wrong on the first turn; after a tool result, right on the first problem and wrong on the second
    first, second = problems
    fake_openai.policy = lambda body, i: ("The answer is 3." if body["messages"][-1]["role"] != "tool" else
                                          right(body, i) if body["messages"][1]["content"] == first else "Done.")
    report = traffic.step()

    assert report.mean_reward == 0.0 and report.rewards_sent == 4
    fixes = [r for r in fake_webhook.accepted if r.source == "operator"]
    assert report.corrections_sent == len(fixes) == 4 + 2         # every first turn; the second problem's next turns
    assert sorted(report.correction_ids) == sorted(f.event_id for f in fixes)
    followed = {rid: body for rid, body in zip(fake_openai.response_ids, fake_openai.requests)
                if body["messages"][-1]["role"] == "tool"}
    assert len(followed) == 4 and all("metadata" not in (b.get("extra_body") or {}) for b in followed.values())
    for body in followed.values():              # the right path: the reference call and its true result
        p = problems[body["messages"][1]["content"]]
        assert body["messages"][-1]["content"] == p.reference[1]["content"]
        assert body["messages"][-2]["tool_calls"][0]["function"] == p.reference[0]["tool_calls"][0]["function"]
    later = [f for f in fixes if f.interaction_id in followed]
    assert {followed[f.interaction_id]["messages"][1]["content"] for f in later} == {second}
    assert all(f.correction.tool_calls[0].function.name == "final_answer" for f in later)
    assert all(f.correction.tool_calls[0].function.arguments ==
               problems[second].reference[2]["tool_calls"][0]["function"]["arguments"] for f in later)


def test_a_following_operator_stops_where_the_path_ends():
    from clora.agents.runtime import EpisodeTrace, Turn
    from clora.agents.simulate import Rollout

    class Refuses:
        calls = 0

        def respond(self, messages):
            self.calls += 1
            raise AgentError("gateway down")

    env, support = ArithmeticEnv(), SupportEnv()
    p, s = env.problem(5, "easy"), support.problem(1, "easy")
    wrong = {"role": "assistant", "content": "3"}
    calc = Rollout(p, EpisodeTrace((*p.messages, wrong), (Turn("i-0", 2, (), "stop", 1, 1),), None, "reply"), 0.0)
    agent = Refuses()
    [fix] = OperatorSimulator(env, share=1.0, follow=agent).review(calc)   # a failed follow keeps the first fix
    assert fix.interaction_id == "i-0" and agent.calls == 1
    reply = Rollout(s, EpisodeTrace((*s.messages, wrong), (Turn("i-1", 2, (), "stop", 1, 1),), "3", "reply"), 0.0)
    assert len(OperatorSimulator(support, share=1.0, follow=agent).review(reply)) == 1 and agent.calls == 1
    assert len(OperatorSimulator(env, share=1.0, follow=agent, max_follow=0).review(calc)) == 1 and agent.calls == 1
    with pytest.raises(ValueError, match="max_follow"):
        OperatorSimulator(env, max_follow=-1)


def test_same_action_ignores_ids_and_json_spacing():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]}
    b = {**a, "tool_calls": [{"id": "b", "type": "function",
                              "function": {"name": "calculator", "arguments": '{"expression":"1+1"}'}}]}
    c = {**a, "tool_calls": [{"id": "c", "type": "function",
                              "function": {"name": "calculator", "arguments": '{"expression": "2"}'}}]}
    assert same_action(a, b) and not same_action(a, c)


def test_tenants_run_concurrently_and_failures_are_reported(fake_openai, openai_client, feedback, fake_webhook):
    support, structured = SupportEnv(), StructuredEnv()
    tenants = [TenantTraffic("t-support", Agent(openai_client, "t-support"), support, feedback, group_size=2),
               TenantTraffic("t-struct", Agent(openai_client, "t-struct"), structured, feedback, group_size=2)]
    policies = {t.tenant: oracle(t.env, t.problems_for(0) + t.problems_for(1)) for t in tenants}
    fake_openai.policy = lambda body, i: policies[body["model"]](body, i)
    seen = []
    reports = run_tenants(tenants, steps=1, on_step=seen.append)
    assert {t: [r.mean_reward for r in rs] for t, rs in reports.items()} == {"t-support": [1.0], "t-struct": [1.0]}
    assert sorted(r.tenant for r in seen) == ["t-struct", "t-support"]
    assert {r.key for r in fake_webhook.accepted} == {"support", "structured"}

    fake_openai.fail_next = 1
    report = tenants[0].step()
    assert len(report.errors) == 1 and "failed" in report.errors[0] and len(report.rollouts) == 2


def test_evaluate_scores_the_held_out_set_greedily(fake_openai, openai_client):
    env = StructuredEnv()
    held = env.held_out()[:4]
    fake_openai.policy = oracle(env, held)
    assert evaluate(Agent(openai_client, "acme"), env, held, concurrency=2) == 1.0
    assert {r["temperature"] for r in fake_openai.requests} == {0.0}
    fake_openai.policy = lambda body, i: "{}"
    assert evaluate(Agent(openai_client, "acme"), env, held) == 0.0


def _knows(env, problems):
    """The oracle on `problems`, "I don't know." on any other."""
    known, keys = oracle(env, problems), {p.key for p in problems}
    return lambda body, i: known(body, i) if body["messages"][1]["content"] in keys else "I don't know."


def test_evaluate_held_out_scores_both_sets_in_one_pass(fake_openai, openai_client):
    env = StructuredEnv()
    fake_openai.policy = _knows(env, env.held_out()[:3])    # right on the traffic's phrasings only
    scores = evaluate_held_out(Agent(openai_client, "acme"), env, 3, concurrency=2)
    assert scores == HeldOutScores(same=1.0, unseen=0.0)
    asked = [r["messages"][1]["content"] for r in fake_openai.requests]
    assert sorted(asked) == sorted(p.key for p in env.held_out()[:3] + env.held_out("unseen")[:3])
    assert {r["temperature"] for r in fake_openai.requests} == {0.0}
    fake_openai.policy = _knows(env, env.held_out("unseen")[:3])
    assert evaluate_held_out(Agent(openai_client, "acme"), env, 3) == HeldOutScores(same=0.0, unseen=1.0)

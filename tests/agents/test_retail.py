"""The retail environment (clora.agents.envs.retail): every tool and policy rule with its
refusals, the simulated customer, τ-bench's reward and its per-rule breakdown, the reference
agent (reward 1 on every seed, through the real agent loop) and a random agent (about 0)."""

import copy
import json
import random

import pytest

from clora.agents.envs import RetailEnv
from clora.agents.envs.retail import MAX_UNHELPFUL, RetailSession, reference_conversation
from clora.agents.envs.retail_store import CATALOG, SCHEMAS, StoreSession, make_store, store_tools
from clora.agents.runtime import Agent
from clora.agents.simulate import OperatorSimulator, Rollout, TenantTraffic, evaluate
from clora.agents.tools import ToolError

from tests.fakes import oracle

NAMES = ("Ana Lopez", "Ben Smith", "Carla Khan", "Dev Novak", "Emma Rossi")


@pytest.fixture
def shop():
    store = make_store(random.Random(5), NAMES)
    session = StoreSession(store)
    return session, store_tools(session)


def _order(store, status):
    return next((oid, o) for oid, o in sorted(store["orders"].items()) if o["status"] == status)


def _login(session, tools, customer_id):
    c = session.store["customers"][customer_id]
    return json.loads(tools.call("find_customer", json.dumps({"name": c["name"], "zip": c["zip"]})))


def _call(tools, tool, **args):
    return tools.call(tool, json.dumps(args))


def test_the_store_is_deterministic_by_seed_and_every_order_is_a_customers():
    a, b = make_store(random.Random(5), NAMES), make_store(random.Random(5), NAMES)
    assert a == b and a != make_store(random.Random(6), NAMES)
    assert {o["customer"] for o in a["orders"].values()} <= set(a["customers"])
    assert {o["status"] for o in a["orders"].values()} <= {"pending", "delivered"}
    assert all(i in CATALOG for o in a["orders"].values() for i in o["items"])


def test_every_tool_has_a_schema_naming_its_required_arguments():
    tools = store_tools(None)
    assert sorted(t.name for t in tools.tools) == sorted(SCHEMAS) and len(tools) == 8
    for t in tools.tools:
        assert set(t.parameters["required"]) <= set(t.parameters["properties"])
    with pytest.raises(ToolError, match="only inside a retail conversation"):
        tools.call("get_order", '{"order_id": "W1"}')


def test_orders_are_hidden_until_the_customer_is_identified_and_only_theirs_after(shop):
    session, tools = shop
    oid, order = _order(session.store, "pending")
    with pytest.raises(ToolError, match="find_customer first"):
        _call(tools, "get_order", order_id=oid)
    with pytest.raises(ToolError, match="no customer named"):
        _call(tools, "find_customer", name="Nobody Here", zip="00000")
    with pytest.raises(ToolError, match="full name and zip code"):
        _call(tools, "find_customer", name="Ana Lopez")
    found = _login(session, tools, order["customer"])
    assert found["customer_id"] == order["customer"]
    shown = json.loads(_call(tools, "get_order", order_id=f"#{oid.lower()}"))   # "#w123" is W123
    assert shown["order_id"] == oid and shown["status"] == "pending"
    assert [i["item_id"] for i in shown["items"]] == order["items"]
    other = next(o for o, v in session.store["orders"].items() if v["customer"] != order["customer"])
    with pytest.raises(ToolError, match="no order"):
        _call(tools, "get_order", order_id=other)
    listed = json.loads(_call(tools, "list_orders", customer_id=order["customer"]))
    assert {o["order_id"] for o in listed} == {o for o, v in session.store["orders"].items()
                                              if v["customer"] == order["customer"]}
    with pytest.raises(ToolError, match="identified customer"):
        _call(tools, "list_orders", customer_id="C0000")
    assert session.refused == 5


def test_cancel_and_change_address_only_for_pending_orders(shop):
    session, tools = shop
    store = session.store
    pending, p = _order(store, "pending")
    _login(session, tools, p["customer"])
    delivered = next((o for o, v in store["orders"].items() if v["customer"] == p["customer"]
                      and v["status"] == "delivered"), None)
    with pytest.raises(ToolError, match="reason must be one of"):
        _call(tools, "cancel_order", order_id=pending, reason="changed my mind")
    with pytest.raises(ToolError, match="full new address"):
        _call(tools, "change_address", order_id=pending, address="x")
    assert "is now 1 Main St, Salem 12345" in _call(tools, "change_address", order_id=pending,
                                                    address="1 Main  St, Salem 12345")
    out = _call(tools, "cancel_order", order_id=pending, reason="ordered by mistake")
    assert "cancelled" in out and store["orders"][pending]["status"] == "cancelled"
    with pytest.raises(ToolError, match="is cancelled: only a pending order can be cancelled"):
        _call(tools, "cancel_order", order_id=pending, reason="ordered by mistake")
    with pytest.raises(ToolError, match="only a pending order can be changed"):
        _call(tools, "change_address", order_id=pending, address="2 Main St, Salem 12345")
    if delivered:
        with pytest.raises(ToolError, match="is delivered"):
            _call(tools, "cancel_order", order_id=delivered, reason="no longer needed")
    assert session.writes == ["change_address", "cancel_order"]


def test_return_and_exchange_only_for_delivered_orders_in_stock_variants_of_the_same_product():
    for seed in range(40):  # a store whose delivered order has an item with an in-stock variant
        session = StoreSession(make_store(random.Random(seed), NAMES))
        tools, store = store_tools(session), session.store
        oid, order = _order(store, "delivered")
        item = order["items"][0]
        variants = [j for j, v in CATALOG.items() if v["product"] == CATALOG[item]["product"] and j != item]
        if any(store["stock"][j] > 0 for j in variants) and any(store["stock"][j] == 0 for j in CATALOG):
            break
    _login(session, tools, order["customer"])
    in_stock = next(j for j in variants if store["stock"][j] > 0)
    other_product = next(j for j, v in CATALOG.items() if v["product"] != CATALOG[item]["product"]
                         and store["stock"][j] > 0)
    with pytest.raises(ToolError, match="not another variant"):
        _call(tools, "exchange_items", order_id=oid, item_ids=[item], new_item_ids=[other_product])
    with pytest.raises(ToolError, match="same length"):
        _call(tools, "exchange_items", order_id=oid, item_ids=[item], new_item_ids=[in_stock, in_stock])
    with pytest.raises(ToolError, match="non-empty list of item ids"):
        _call(tools, "return_items", order_id=oid, item_ids="I1001")
    not_in_order = next(j for j in CATALOG if j not in order["items"])
    with pytest.raises(ToolError, match="distinct items of order"):
        _call(tools, "return_items", order_id=oid, item_ids=[not_in_order])
    pending, p = next((o, v) for o, v in store["orders"].items()
                      if v["customer"] == order["customer"] and v["status"] == "pending") or (None, None)
    if pending:
        with pytest.raises(ToolError, match="only a delivered order can be returned"):
            _call(tools, "return_items", order_id=pending, item_ids=p["items"][:1])
    before = store["stock"][in_stock]
    out = _call(tools, "exchange_items", order_id=oid, item_ids=[item], new_item_ids=[in_stock])
    assert "Exchange" in out and store["stock"][in_stock] == before - 1
    assert store["orders"][oid]["exchange"] == {item: in_stock}
    with pytest.raises(ToolError, match="exchange requested: only a delivered order can be returned"):
        _call(tools, "return_items", order_id=oid, item_ids=[item])


def test_out_of_stock_variants_are_refused_and_not_offered():
    for seed in range(200):
        session = StoreSession(make_store(random.Random(seed), NAMES))
        store = session.store
        gone = next(j for j, n in store["stock"].items() if n == 0)
        hit = [(o, v) for o, v in store["orders"].items() if v["status"] == "delivered"
               and any(CATALOG[i]["product"] == CATALOG[gone]["product"] and i != gone for i in v["items"])]
        if hit:
            break
    oid, order = hit[0]
    tools = store_tools(session)
    _login(session, tools, order["customer"])
    item = next(i for i in order["items"] if CATALOG[i]["product"] == CATALOG[gone]["product"])
    shown = json.loads(_call(tools, "get_order", order_id=oid))
    assert gone not in next(i for i in shown["items"] if i["item_id"] == item)["exchange_options"].values()
    with pytest.raises(ToolError, match="out of stock"):
        _call(tools, "exchange_items", order_id=oid, item_ids=[item], new_item_ids=[gone])


def test_transfer_needs_a_summary_and_is_recorded(shop):
    session, tools = shop
    with pytest.raises(ToolError, match="summary"):
        _call(tools, "transfer_to_human", summary=" ")
    with pytest.raises(ToolError, match="unknown arguments"):
        _call(tools, "transfer_to_human", summary="x", urgent=True)
    assert "human agent" in _call(tools, "transfer_to_human", summary="Wants a price adjustment.")
    assert session.store["transfers"] == ["Wants a price adjustment."]


# --- the customer, the reward and the reference agent -----------------------------------------

ENV = RetailEnv()


def _all(problem):
    return list(problem.messages) + list(problem.reference)


def test_the_customer_answers_questions_from_its_goal_and_ends_when_it_is_met():
    p = ENV.problem(3, "medium")
    g = p.expected
    s = ENV.session(p)
    assert g.name not in p.key and g.order_id not in p.key            # medium volunteers nothing
    assert s.reply("Could you give me your name and zip code?") == f"My name is {g.name} and my zip code is {g.zip}."
    assert g.order_id in s.reply("Which order is this about?")
    assert s.reply("Shall I proceed?") == "Yes, please go ahead." and s.customer.said_yes
    assert s.reply("Lovely weather.").startswith("Sorry, I just want help") and not s.customer.said_yes
    easy = ENV.problem(3, "easy")
    assert easy.expected.name in easy.key and easy.expected.order_id in easy.key    # easy volunteers it all


def test_the_customer_ends_on_a_refusal_or_after_going_nowhere():
    p = ENV.problem(4, "medium")
    s = ENV.session(p)
    assert s.reply("I'm sorry, I cannot do that.") is None and s.customer.ended
    s = ENV.session(p)
    answers = [s.reply("Hmm.") for _ in range(MAX_UNHELPFUL + 1)]
    assert all(a for a in answers[:-1]) and answers[-1] is None


def test_the_reference_conversation_earns_reward_one_on_every_seed_and_family():
    kinds = set()
    for family in ("same", "unseen"):
        for d in ("easy", "medium", "hard"):
            for seed in range(60):
                p = ENV.problem(seed, d, family)
                kinds.add(p.expected.kind)
                b = ENV.breakdown(p, _all(p))
                assert b == {"reward": 1.0, "state": 1.0, "info": 1.0, "identified_first": 1.0,
                             "confirmed_writes": 1.0, "no_refusals": 1.0, "customer_ended": 1.0}, (p.key, b)
    assert kinds == {"cancel", "address", "return", "exchange", "refuse_cancel", "transfer"}


def test_reward_needs_both_the_final_state_and_the_information():
    p = next(ENV.problem(s, "medium") for s in range(50) if ENV.problem(s, "medium").expected.kind == "cancel")
    full = _all(p)
    last = full[-1]
    assert last["role"] == "assistant" and p.expected.info[0] in last["content"]
    silent = full[:-1] + [{"role": "assistant", "content": "All done, goodbye."}]
    assert ENV.breakdown(p, silent) | {} == {**ENV.breakdown(p, full), "reward": 0.0, "info": 0.0}
    write = next(i for i, m in enumerate(full) if (m.get("tool_calls") or [{}])[0].get("function", {}).get("name")
                 == "cancel_order")
    unchanged = full[:write] + [{"role": "assistant", "content": f"Your refund is {p.expected.info[0]}."}]
    b = ENV.breakdown(p, unchanged)
    assert (b["reward"], b["state"], b["info"]) == (0.0, 0.0, 1.0)
    assert ENV.breakdown(p, list(p.messages)) == {**b, "info": 0.0, "customer_ended": 0.0}


def test_breakdown_flags_a_write_without_confirmation_and_a_refused_call():
    p = next(ENV.problem(s, "easy") for s in range(50) if ENV.problem(s, "easy").expected.kind == "cancel")
    rushed = [m for m in _all(p)]
    ask = next(i for i, m in enumerate(rushed) if "Shall I proceed" in (m.get("content") or ""))
    rushed = rushed[:ask] + rushed[ask + 2:]                         # the proposal and the yes removed
    bad = {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "cancel_order", "arguments": json.dumps({"order_id": p.expected.order_id, "reason": "meh"})}}]}
    rushed = rushed[:ask] + [bad, {"role": "tool", "tool_call_id": "x", "content": "error"}] + rushed[ask:]
    b = ENV.breakdown(p, rushed)
    assert b["reward"] == 1.0 and b["confirmed_writes"] == 0.0 and b["no_refusals"] == 0.0


def test_policy_breaking_requests_must_be_refused_and_explained():
    p = next(ENV.problem(s, "hard") for s in range(50) if ENV.problem(s, "hard").expected.kind == "refuse_cancel")
    assert "cannot be cancelled" in p.reference[-1]["content"] and ENV.breakdown(p, _all(p))["reward"] == 1.0
    vague = _all(p)[:-1] + [{"role": "assistant", "content": "Sorry, that is not possible."}]
    assert ENV.breakdown(p, vague)["reward"] == 0.0          # refused, but not why (it was delivered)


def test_the_reference_agent_through_the_agent_loop_scores_one(fake_openai, openai_client):
    problems = [ENV.problem(s, d) for s in range(4) for d in ("easy", "medium", "hard")]
    fake_openai.policy = oracle(ENV, problems)
    agent = Agent(openai_client, "shop", ENV.tools, max_turns=ENV.max_turns, temperature=0.0)
    traces = [agent.run(list(p.messages), session=ENV.session(p)) for p in problems]
    assert [ENV.score(p, t) for p, t in zip(problems, traces)] == [1.0] * len(problems)
    longest = max(traces, key=lambda t: len(t.turns))
    assert len(longest.turns) >= 7 and longest.stop == "reply"
    assert [m["role"] for m in longest.messages].count("user") >= 3       # the customer answered back
    later = fake_openai.requests[1:len(traces[0].turns)]
    assert all(r["metadata"] == {"episode_id": traces[0].interaction_ids[0]} for r in later)
    assert evaluate(agent, ENV, problems, concurrency=2) == 1.0


def test_group_rollouts_get_a_store_each(fake_openai, openai_client):
    p = next(ENV.problem(s, "easy") for s in range(50) if ENV.problem(s, "easy").expected.kind == "cancel")
    fake_openai.policy = oracle(ENV, [p])
    traces = Agent(openai_client, "shop", ENV.tools, max_turns=ENV.max_turns).run_group(
        list(p.messages), 3, session=ENV.session(p))
    assert [ENV.score(p, t) for t in traces] == [1.0, 1.0, 1.0]          # none found it already cancelled


def _random_action(rng: random.Random, p) -> dict:
    if rng.random() < 0.4:
        return {"role": "assistant", "content": rng.choice(["OK.", "Let me check.", "Anything else?",
                                                           "Could you tell me your name and zip code?"])}
    name = rng.choice(sorted(SCHEMAS))
    g = p.expected
    values = {"name": g.name, "zip": g.zip, "order_id": rng.choice(sorted(g.store["orders"])),
              "customer_id": g.customer_id, "reason": rng.choice(["no longer needed", "ordered by mistake"]),
              "address": "1 Main St, Salem 12345", "item_ids": [rng.choice(sorted(CATALOG))],
              "new_item_ids": [rng.choice(sorted(CATALOG))], "summary": "help"}
    args = {k: values[k] for k in SCHEMAS[name][1]}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "r", "type": "function", "function": {
        "name": name, "arguments": json.dumps(args)}}]}


def test_a_randomly_acting_agent_scores_about_zero():
    rng = random.Random(0)
    rewards = []
    for seed in range(150):
        p = ENV.problem(seed, ("easy", "medium", "hard")[seed % 3])
        messages = list(p.messages)
        for _ in range(ENV.max_turns):
            action = _random_action(rng, p)
            following = ENV.follow(p, messages, action)
            messages.append(action)
            if following is None:
                break
            messages += following
        rewards.append(ENV.breakdown(p, messages)["reward"])
    assert sum(rewards) / len(rewards) < 0.05, sum(rewards)


def test_the_operator_corrects_the_first_wrong_turn_with_the_reference_action():
    p = ENV.problem(3, "medium")
    full = _all(p)
    wrong = full[:2] + [{"role": "assistant", "content": "Your order is cancelled!"}]   # no identification
    assert ENV.correction(p, full[:2]) == p.reference[0]
    for i, m in enumerate(full):
        if m["role"] == "assistant":
            assert ENV.correction(p, full[:i]) == m       # the reference at every point of its own path
    from clora.agents.runtime import EpisodeTrace, Turn
    trace = EpisodeTrace(tuple(wrong), (Turn("iid-1", 2, (), "stop", 10, 5),), "Your order is cancelled!", "reply")
    rollout = Rollout(p, trace, ENV.score(p, trace))
    fixes = OperatorSimulator(ENV, share=1.0).review(rollout)
    assert rollout.reward == 0.0 and len(fixes) == 1 and fixes[0].interaction_id == "iid-1"
    assert fixes[0].correction.content == p.reference[0]["content"]


def test_the_operator_walks_a_conversation_with_the_customers_answers(fake_openai, openai_client):
    p = ENV.problem(3, "medium")
    fake_openai.policy = lambda body, i: "Hello!"                 # the agent never gets it right
    agent = Agent(openai_client, "shop", ENV.tools, max_turns=ENV.max_turns)
    trace = agent.run(list(p.messages), session=ENV.session(p))
    rollout = Rollout(p, trace, ENV.score(p, trace))
    fixes = OperatorSimulator(ENV, share=1.0, follow=agent, max_follow=3).review(rollout)
    assert len(fixes) == 4                          # the first wrong turn, then 3 along the right path
    walked = fake_openai.requests[len(trace.turns):]
    assert walked[0]["messages"][-1] == {"role": "user", "content": p.reference[1]["content"]}   # its answer


def test_tenant_traffic_scores_retail_conversations(fake_openai, openai_client, fake_webhook):
    from clora.agents.feedback import FeedbackClient

    with FeedbackClient(fake_webhook.url, "key-1", sleep=lambda s: None) as feedback:
        traffic = TenantTraffic("shop", Agent(openai_client, "shop", ENV.tools, max_turns=ENV.max_turns), ENV,
                                feedback, group_size=2, prompts_per_step=2)
        fake_openai.policy = oracle(ENV, traffic.problems_for(0))
        report = traffic.step()
    assert report.errors == () and [r.reward for r in report.rollouts] == [1.0] * 4
    turns = sum(len(r.trace.turns) for r in report.rollouts)
    assert report.rewards_sent == turns and turns >= 4 * 5
    ids = [r.interaction_id for r in fake_webhook.accepted]
    assert len(ids) == len(set(ids)) == turns
    comments = {r.comment for r in fake_webhook.accepted}          # the rules, for the console
    assert comments == {"state ✓ · info ✓ · identified_first ✓ · confirmed_writes ✓ · no_refusals ✓ · "
                        "customer_ended ✓"}


def test_store_copies_do_not_leak_between_problems():
    p = ENV.problem(9, "easy")
    before = copy.deepcopy(p.expected.store)
    RetailSession.replay(p, list(p.reference))
    reference_conversation(p)
    assert p.expected.store == before

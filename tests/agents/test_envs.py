"""Environments: seeded generators, held-out sets disjoint from training, rewards, references."""

import json

import pytest

from clora.agents.envs import DIFFICULTIES, ENVIRONMENTS, ArithmeticEnv, StructuredEnv, SupportEnv
from clora.agents.envs.arithmetic import calculator_call, final_answer_call, parse_number
from clora.agents.tools import evaluate


@pytest.fixture(params=sorted(ENVIRONMENTS))
def env(request):
    return ENVIRONMENTS[request.param]()


def _reference_answer(env, problem):
    """What the agent's answer is when it follows the reference."""
    last = problem.reference[-1]
    if last.get("tool_calls"):
        return str(json.loads(last["tool_calls"][0]["function"]["arguments"])["answer"])
    return last["content"]


def test_generators_are_deterministic_by_seed(env):
    fresh = type(env)()
    for d in DIFFICULTIES:
        assert env.problem(7, d) == fresh.problem(7, d)
    assert env.train_problems(20, seed=3) == fresh.train_problems(20, seed=3)
    assert [p.key for p in env.train_problems(20, seed=3)] != [p.key for p in env.train_problems(20, seed=4)]
    assert len({env.problem(s, "easy").key for s in range(30)}) >= 25


def test_held_out_is_fixed_distinct_and_disjoint_from_training(env):
    held = env.held_out()
    assert held == type(env)().held_out()
    assert len({p.key for p in held}) == len(held) == env.held_out_size
    assert {p.difficulty for p in held} == set(DIFFICULTIES)
    train = [p for seed in range(5) for p in env.train_problems(200, seed=seed)]
    assert not {p.key for p in held} & {p.key for p in train}


def test_difficulty_is_respected_and_validated(env):
    assert {p.difficulty for p in env.train_problems(10, seed=1, difficulty="hard")} == {"hard"}
    with pytest.raises(ValueError, match="difficulty must be one of"):
        env.problem(1, "extreme")


def test_reference_earns_full_reward_and_garbage_earns_none(env):
    for p in env.train_problems(30, seed=11):
        assert env.reward(p, _reference_answer(env, p)) == 1.0, p.key
        assert env.reward(p, None) == 0.0
        assert env.reward(p, "") == 0.0


def test_prompts_and_references_stay_short(env):
    for p in env.held_out():
        assert len(p.key) < 160
        assert len(json.dumps(p.reference[-1])) < 260


# --- arithmetic -------------------------------------------------------------------------

def test_arithmetic_answers_are_whole_and_match_the_reference_expression():
    env = ArithmeticEnv()
    for p in env.train_problems(60, seed=2):
        expr = json.loads(p.reference[0]["tool_calls"][0]["function"]["arguments"])["expression"]
        assert evaluate(expr) == p.expected and isinstance(p.expected, int) and p.expected >= 0
        assert p.reference[1] == {"role": "tool", "tool_call_id": "call_calc", "content": str(p.expected)}


@pytest.mark.parametrize("answer, reward", [
    ("51", 1.0), ("51.0", 1.0), (" 51 ", 1.0), ("$51", 1.0), ("51.0000001", 1.0),
    ("52", 0.0), ("-51", 0.0), ("51 apples", 0.0), ("fifty-one", 0.0), ("5 1", 0.0), ("nan", 0.0), ("inf", 0.0),
])
def test_arithmetic_reward_compares_numbers(answer, reward):
    env = ArithmeticEnv()
    p = env.problem(0, "easy")
    p = type(p)(p.env, p.difficulty, p.key, p.messages, 51, p.reference)
    assert env.reward(p, answer) == reward


def test_parse_number_handles_thousands_separators():
    assert parse_number("1,234") == 1234.0 and parse_number("1e3") == 1000.0 and parse_number("abc") is None


def test_arithmetic_correction_is_calculator_first_then_final_answer():
    env = ArithmeticEnv()
    p = env.problem(5, "medium")
    prompt = list(p.messages)
    assert env.correction(p, prompt) == p.reference[0]
    wrong = prompt + [calculator_call("1+1", "x"), {"role": "tool", "tool_call_id": "x", "content": "2"}]
    assert env.correction(p, wrong) == p.reference[0]
    right = prompt + [calculator_call("0", "x"), {"role": "tool", "tool_call_id": "x", "content": str(p.expected)}]
    assert env.correction(p, right) == final_answer_call(p.expected)


# --- support ----------------------------------------------------------------------------

def test_support_reward_is_the_share_of_style_rules_met():
    env = SupportEnv()
    p = env.problem(3, "easy")
    name, order = p.expected.name, p.expected.order
    assert env.reward(p, f"Hi {name},\nWe are on order #{order}.\n— Acme Support") == 1.0
    assert env.rules_met(p, f"Hello {name}! Checking #{order} now.") == {
        "greets_by_name": True, "mentions_order": True, "signs_off": False}
    assert env.reward(p, f"Checking order #{order}.\n— Acme Support") == pytest.approx(2 / 3)
    assert env.reward(p, "Hi Bob,\nSorry.\n— Acme Support\nP.S. bye") == 0.0
    assert env.reward(p, "Thanks for reaching out!") == 0.0


def test_support_correction_is_the_styled_reference():
    env = SupportEnv()
    p = env.problem(9, "hard")
    fix = env.correction(p, list(p.messages))
    assert fix["role"] == "assistant" and fix["content"].startswith(f"Hi {p.expected.name},")
    assert env.reward(p, fix["content"]) == 1.0


# --- structured -------------------------------------------------------------------------

def test_structured_reward_gives_credit_per_field():
    env = StructuredEnv()
    p = env.problem(4, "medium")
    want = p.expected
    assert set(want) == {"name", "city", "quantity"}
    assert env.reward(p, json.dumps(want)) == 1.0
    assert env.reward(p, json.dumps({**want, "quantity": str(want["quantity"]), "name": want["name"].upper()})) == 1.0
    assert env.reward(p, json.dumps({**want, "city": "Atlantis"})) == pytest.approx(2 / 3)
    assert env.reward(p, json.dumps({k: want[k] for k in ("name", "city")})) == pytest.approx(2 / 3)
    assert env.reward(p, json.dumps({**want, "extra": 1})) == pytest.approx(3 / 4)
    assert env.reward(p, json.dumps({**want, "quantity": True})) == pytest.approx(2 / 3)


@pytest.mark.parametrize("answer", ["", "not json", "```json\n{}\n```", "[1, 2]", '"text"', '{"name": ', "{}"])
def test_structured_reward_is_zero_for_malformed_or_empty_output(answer):
    env = StructuredEnv()
    assert env.reward(env.problem(4, "easy"), answer) == 0.0


def test_an_environment_limited_to_some_difficulties_draws_and_holds_out_only_those():
    env = ArithmeticEnv(difficulties=("easy",))
    assert {p.difficulty for p in env.held_out()} == {"easy"}
    assert len(env.held_out()) == env.held_out_size
    assert {p.difficulty for p in env.train_problems(20, seed=3)} == {"easy"}
    held = {p.key for p in env.held_out()}
    assert not held & {p.key for p in env.train_problems(50, seed=4)}


def test_unknown_difficulty_is_refused_by_name():
    import pytest

    with pytest.raises(ValueError, match="difficulties"):
        ArithmeticEnv(difficulties=("trivial",))
    with pytest.raises(ValueError, match="difficulties"):
        SupportEnv(difficulties=())

"""Environments: seeded generators, held-out sets disjoint from training (and an unseen-phrasings
set sharing no sentence shape with it), rewards, references."""

import json
import random
import re

import pytest

from clora.agents.envs import DIFFICULTIES, ENVIRONMENTS, ArithmeticEnv, StructuredEnv, SupportEnv, TaskEnv
from clora.agents.envs import arithmetic, structured, support
from clora.agents.envs.arithmetic import calculator_call, final_answer_call, parse_number
from clora.agents.tools import evaluate


@pytest.fixture(params=sorted(ENVIRONMENTS))
def env(request):
    return ENVIRONMENTS[request.param]()


@pytest.fixture(params=sorted(n for n in ENVIRONMENTS if n != "retail"))
def answer_env(request):
    """The environments whose reward is the answer's alone (retail scores a whole conversation;
    its own tests are in test_retail.py)."""
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


def test_reference_earns_full_reward_and_garbage_earns_none(answer_env):
    env = answer_env
    for p in env.train_problems(30, seed=11):
        assert env.reward(p, _reference_answer(env, p)) == 1.0, p.key
        assert env.reward(p, None) == 0.0
        assert env.reward(p, "") == 0.0


def test_prompts_and_references_stay_short(answer_env):
    env = answer_env
    for p in env.held_out() + env.held_out("unseen"):
        assert len(p.key) < 160, p.key
        assert len(json.dumps(p.reference[-1])) < 260


# --- the unseen phrasings -------------------------------------------------------------------

SLOT_WORDS = {   # per environment: (the traffic's words, the unseen set's words) of each slot
    "arithmetic": [(arithmetic.NAMES, arithmetic.UNSEEN_NAMES), (arithmetic.ITEMS, arithmetic.UNSEEN_ITEMS)],
    "support": [(support.NAMES, support.UNSEEN_NAMES)],
    "structured": [(structured.FIRST, structured.UNSEEN_FIRST), (structured.LAST, structured.UNSEEN_LAST),
                   (structured.CITIES, structured.UNSEEN_CITIES), (structured.ITEMS, structured.UNSEEN_ITEMS)],
}
TEMPLATES = {"arithmetic": 4 + 3 + 2, "support": 4 * 3, "structured": 3}
"""Sentence shapes per family: arithmetic's templates per difficulty, support's issues x
difficulties, structured's one note per difficulty."""
NUM, WORD = "<n>", "<w>"


def skeleton(env, text: str) -> str:
    """`text` with its numbers and slot words (names, items, cities of either family) abstracted:
    "Sam has 4 bags with 7 apples each." -> "<w> has <n> bags with <n> <w> each."."""
    words = sorted({w for slot in SLOT_WORDS[env.name] for family in slot for w in family}, key=len, reverse=True)
    text = re.sub(r"\d+", NUM, text)
    return re.sub(r"\b(" + "|".join(map(re.escape, words)) + r")\b", WORD, text)


def template_pattern(skel: str) -> re.Pattern:
    """A training skeleton as a pattern whose slots take any number and any one or two words."""
    parts = re.split(f"({re.escape(NUM)}|{re.escape(WORD)})", skel)
    return re.compile("".join(r"\d+" if p == NUM else r"[^\s.,;:!?]+(?: [^\s.,;:!?]+)?" if p == WORD
                              else re.escape(p) for p in parts))


def _traffic(env):
    return [p for seed in range(3) for p in env.train_problems(300, seed=seed)]


def _unseen(env):
    return [env.problem(seed, d, "unseen") for seed in range(300) for d in env.difficulties]


def test_unseen_phrasings_share_no_sentence_skeleton_and_no_word_with_traffic(answer_env):
    env = answer_env
    traffic = {skeleton(env, p.key) for p in _traffic(env) + env.held_out()}
    unseen = {skeleton(env, p.key) for p in _unseen(env) + env.held_out("unseen")}
    # every template of each family was drawn, so disjointness covers them all
    assert len(traffic) == len(unseen) == TEMPLATES[env.name], (sorted(traffic), sorted(unseen))
    assert not traffic & unseen
    for same_words, unseen_words in SLOT_WORDS[env.name]:
        assert not set(same_words) & set(unseen_words)


def test_no_unseen_problem_matches_a_training_template_with_any_words_in_its_slots(answer_env):
    env = answer_env
    traffic = _traffic(env)
    patterns = [template_pattern(s) for s in {skeleton(env, p.key) for p in traffic}]
    assert all(any(pat.fullmatch(p.key) for pat in patterns) for p in traffic)     # the patterns describe traffic
    assert any(pat.fullmatch("Zed has 3 bags with 4 kiwis each. How many kiwis does Zed have?") for pat in patterns) \
        or env.name != "arithmetic"                                                 # ... with words it never uses
    matched = [p.key for p in _unseen(env) if any(pat.fullmatch(p.key) for pat in patterns)]
    assert matched == []


def test_unseen_held_out_set_is_fixed_distinct_and_never_drawn_by_traffic(env):
    held = env.held_out("unseen")
    assert held == type(env)().held_out("unseen")
    assert len({p.key for p in held}) == len(held) == env.held_out_size
    assert {p.difficulty for p in held} == set(DIFFICULTIES) and {p.family for p in held} == {"unseen"}
    assert env.problem(7, "hard", "unseen") == type(env)().problem(7, "hard", "unseen")
    assert env.problem(7, "hard", "unseen").key != env.problem(8, "hard", "unseen").key
    traffic = _traffic(env)
    assert {p.family for p in traffic} == {"same"} and {p.family for p in env.held_out()} == {"same"}
    assert not {p.key for p in held} & ({p.key for p in traffic} | {p.key for p in env.held_out()})


def _wrong_answer(env, problem) -> str:
    """An answer that breaks every rule: a wrong number, a reply without the house style, wrong fields."""
    if env.name == "arithmetic":
        return str(problem.expected + 1)
    if env.name == "support":
        return "Hello there, we are looking into it."
    return json.dumps({k: "nothing" for k in problem.expected})


def test_unseen_references_earn_full_reward_and_wrong_answers_none(answer_env):
    env = answer_env
    problems = env.held_out("unseen") + _unseen(env)[:60]
    for p in problems:
        assert env.reward(p, _reference_answer(env, p)) == 1.0, p.key
        assert env.reward(p, _wrong_answer(env, p)) == 0.0, p.key
        assert env.reward(p, None) == 0.0
        assert env.correction(p, list(p.messages)) == p.reference[0]


def test_unseen_arithmetic_asks_the_same_operations_on_whole_numbers():
    env = ArithmeticEnv()
    ops = {}
    for family in ("same", "unseen"):
        for p in [env.problem(s, d, family) for s in range(200) for d in DIFFICULTIES]:
            expr = json.loads(p.reference[0]["tool_calls"][0]["function"]["arguments"])["expression"]
            assert evaluate(expr) == p.expected and isinstance(p.expected, int) and p.expected >= 0
            ops.setdefault(family, set()).add((p.difficulty, re.sub(r"\d+", "n", expr)))
    assert ops["same"] == ops["unseen"]
    split = next(p for s in range(200) if (p := env.problem(s, "easy", "unseen")).key.startswith("Split "))
    assert re.fullmatch(r"Split (\d+) \w+ evenly among (\d+) jars\. How many per jar\?", split.key)


def test_unseen_structured_problems_ask_for_the_keys_in_another_order():
    env = StructuredEnv()
    for d in DIFFICULTIES:
        same, unseen = env.problem(1, d), env.problem(1, d, "unseen")
        assert set(same.expected) == set(unseen.expected) and list(same.expected) != list(unseen.expected)
        assert unseen.key.startswith(f"Keys: {', '.join(unseen.expected)}.")


def test_an_unknown_family_is_refused_and_an_environment_without_unseen_phrasings_says_so():
    with pytest.raises(ValueError, match="family must be one of"):
        ArithmeticEnv().problem(1, "easy", "novel")

    class Echo(TaskEnv):
        name = "echo"

        def _make(self, rng: random.Random, difficulty):
            return ArithmeticEnv()._make(rng, difficulty)

    assert len(Echo().held_out()) == Echo.held_out_size
    with pytest.raises(NotImplementedError, match="echo: this environment has no unseen phrasings"):
        Echo().held_out("unseen")


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

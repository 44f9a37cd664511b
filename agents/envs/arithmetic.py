"""GSM8K-style arithmetic word problems solved with the Calculator and FinalAnswer tools.

Reward is 1.0 only when the agent calls `final_answer` with the right number (numeric
compare, relative tolerance 1e-6; "1,234", "$12" and "12.0" are numbers), else 0.0 —
a right number written as plain text earns nothing: the task teaches the tool format.

Difficulties: easy = one operation, medium = two, hard = three with larger numbers.
Every answer is a whole number. Each difficulty has the traffic's templates (`same`) and, for
the unseen held-out set, the same operations on the same numbers worded otherwise, with other
names and items (`unseen`): "Split 84 beads evenly among 7 jars. How many per jar?" vs the
traffic's "84 marbles are shared equally by 7 kids. How many does each kid get?".

The reference solution is the three messages an SFT correction teaches: a calculator call
with the whole expression, its result, and the final_answer call.
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

from clora.agents.envs.base import DIFFICULTIES, Difficulty, Family, Problem, TaskEnv
from clora.agents.tools import Calculator, FinalAnswer, ToolRegistry, evaluate

SYSTEM = "Solve the problem. Use the calculator, then call final_answer."

NAMES = ("Sam", "Ana", "Leo", "Mia", "Tom", "Zoe", "Ben", "Ivy", "Max", "Eva", "Noah", "Lily")
ITEMS = ("apples", "pens", "cards", "stickers", "cookies", "books", "marbles", "shells")
UNSEEN_NAMES = ("Olivia", "Ravi", "Kofi", "Hana", "Luis", "Greta", "Omar", "Yara", "Finn", "Nia", "Jonah", "Elif")
UNSEEN_ITEMS = ("beads", "coins", "stamps", "buttons", "crayons", "seeds", "tickets", "candles")

_NUMBER_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _easy(r: random.Random, who: str, item: str, family: Family) -> tuple[str, str]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    if family == "same":
        return r.choice([
            (f"{who} has {a} bags with {b} {item} each. How many {item} does {who} have?", f"{a}*{b}"),
            (f"{who} had {a * b + a} {item} and got {b + 10} more. How many {item} now?", f"{a * b + a}+{b + 10}"),
            (f"{who} had {a * b + 20} {item} and gave away {a + 9}. How many are left?", f"{a * b + 20}-{a + 9}"),
            (f"{a * b} {item} are shared equally by {a} kids. How many does each kid get?", f"{a * b}/{a}"),
        ])
    return r.choice([
        (f"There are {a} jars and every jar holds {b} {item}. What is the total number of {item}?", f"{a}*{b}"),
        (f"On Monday {who} collected {a * b + a} {item}; on Tuesday, {b + 10}. What is the total?",
         f"{a * b + a}+{b + 10}"),
        (f"A box held {a * b + 20} {item}. {who} took out {a + 9} of them. How many remain in the box?",
         f"{a * b + 20}-{a + 9}"),
        (f"Split {a * b} {item} evenly among {a} jars. How many per jar?", f"{a * b}/{a}"),
    ])


def _medium(r: random.Random, who: str, item: str, family: Family) -> tuple[str, str]:
    a, b, c = r.randint(2, 12), r.randint(3, 15), r.randint(2, 30)
    if family == "same":
        return r.choice([
            (f"{who} buys {a} packs of {b} {item} and finds {c} more. How many {item} in total?", f"{a}*{b}+{c}"),
            (f"{who} had {a * b + c} {item} and sold {a} boxes of {b}. How many are left?", f"{a * b + c}-{a}*{b}"),
            (f"{who} has {a * b} {item} and {c * a} more, shared by {a} friends. How many each?",
             f"({a * b}+{c * a})/{a}"),
        ])
    return r.choice([
        (f"Each of {a} shelves holds {b} {item}, and {c} more lie on the floor. Count all the {item}.",
         f"{a}*{b}+{c}"),
        (f"A shop opens with {a * b + c} {item} and sells {a} bundles of {b}. What is still in stock?",
         f"{a * b + c}-{a}*{b}"),
        (f"{who} gathers {a * b} {item} in the morning and {c * a} later, then fills {a} bags equally. "
         f"What goes in each bag?", f"({a * b}+{c * a})/{a}"),
    ])


def _hard(r: random.Random, who: str, item: str, family: Family) -> tuple[str, str]:
    a, b, d = r.randint(11, 40), r.randint(6, 25), r.randint(2, 5)
    c = r.randint(10, min(99, a * b - 10))
    total = a * b - c
    total -= total % d  # make the split exact
    c = a * b - total
    if family == "same":
        return r.choice([
            (f"{who} earns {a} dollars an hour for {b} hours, spends {c} and splits the rest among {d} people. "
             f"How much does each get?", f"({a}*{b}-{c})/{d}"),
            (f"A store gets {a} crates of {b} {item}, throws away {c} and packs the rest into {d} boxes. "
             f"How many {item} per box?", f"({a}*{b}-{c})/{d}"),
        ])
    return r.choice([
        (f"For {b} hours of work at {a} dollars per hour, {who} pays {c} dollars in fees and divides what "
         f"remains equally among {d} siblings. What is one share?", f"({a}*{b}-{c})/{d}"),
        (f"A factory fills {a} trays with {b} {item} each, rejects {c} as faulty and ships the remainder in "
         f"{d} equal loads. What is in one load?", f"({a}*{b}-{c})/{d}"),
    ])


_MAKERS = {"easy": _easy, "medium": _medium, "hard": _hard}


def parse_number(text: str | None) -> float | None:
    """The number in an answer like "51", " 51.0", "$1,234" — None when it is not one number."""
    if text is None:
        return None
    t = str(text).strip().replace(",", "").lstrip("$").strip()
    if not _NUMBER_RE.match(t):
        return None
    value = float(t)
    return value if math.isfinite(value) else None


def calculator_call(expression: str, call_id: str = "call_calc") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": expression})}}]}


def final_answer_call(answer: int | float, call_id: str = "call_final") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": "final_answer", "arguments": json.dumps({"answer": answer})}}]}


class ArithmeticEnv(TaskEnv):
    name = "arithmetic"
    tools = ToolRegistry.of([Calculator, FinalAnswer])

    def __init__(self, tolerance: float = 1e-6, difficulties: tuple[Difficulty, ...] = DIFFICULTIES):
        super().__init__(difficulties)
        self.tolerance = tolerance

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        text, expr = _MAKERS[difficulty](rng, rng.choice(NAMES), rng.choice(ITEMS), "same")
        return self._problem(difficulty, text, expr)

    def _make_unseen(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        text, expr = _MAKERS[difficulty](rng, rng.choice(UNSEEN_NAMES), rng.choice(UNSEEN_ITEMS), "unseen")
        return self._problem(difficulty, text, expr)

    def _problem(self, difficulty: Difficulty, text: str, expr: str) -> Problem:
        value = evaluate(expr)
        assert float(value).is_integer(), f"{expr} = {value} is not whole"
        answer = int(value)
        reference = (calculator_call(expr), {"role": "tool", "tool_call_id": "call_calc", "content": str(answer)},
                     final_answer_call(answer))
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": text})
        return Problem(self.name, difficulty, text, messages, answer, reference)

    def reward(self, problem: Problem, answer: str | None) -> float:
        value = parse_number(answer)
        if value is None:
            return 0.0
        return 1.0 if math.isclose(value, problem.expected, rel_tol=self.tolerance, abs_tol=self.tolerance) else 0.0

    def correction(self, problem: Problem, prompt: list[dict[str, Any]]) -> dict[str, Any]:
        """final_answer once a tool result in `prompt` holds the right number; the calculator call before that."""
        results = [m.get("content") for m in prompt[len(problem.messages):] if m.get("role") == "tool"]
        if any(self.reward(problem, r) == 1.0 for r in results):
            return dict(problem.reference[2])
        return dict(problem.reference[0])

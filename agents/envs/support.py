"""Support replies in the house style, learned from operator corrections.

The customer's name and order number are in the prompt; the style rules (`RULES`) are
what the operator enforces and the base model does not know: greet the customer by name
on the first line ("Hi Maria,"), mention the order number ("#4821"), and end with the
sign-off "— Acme Support". Reward = the fraction of rules met. The correction is the
reference reply: short, in style, for that customer's issue.

Difficulties change how the customer writes (short, chatty, with an unrelated number as
a distractor), not the rules. Traffic's messages open with the customer's name ("Maria: my
order #4821 has not arrived yet."); the unseen held-out set has other customers who write
other sentences about the same issues and sign with their name ("Still nothing for parcel
#4821. Any news? — Hannah"), with the same rules, reference replies and reward.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from clora.agents.envs.base import DIFFICULTIES, Difficulty, Problem, TaskEnv

SYSTEM = "You are a support agent for Acme. Reply to the customer."
SIGN_OFF = "— Acme Support"

NAMES = ("Maria", "John", "Aiko", "Omar", "Grace", "Lukas", "Priya", "Diego", "Chloe", "Ivan", "Fatima", "Noah")
ISSUES = {
    "late": ("my order #{order} has not arrived yet", "Sorry order #{order} is late. It ships within 2 days."),
    "damaged": ("order #{order} arrived damaged", "Sorry order #{order} arrived damaged. A replacement is on its way."),
    "refund": ("I want a refund for order #{order}", "Your refund for order #{order} is approved. It takes 5 days."),
    "address": ("can I change the address on order #{order}", "Yes, reply with the new address for order #{order}."),
}
UNSEEN_NAMES = ("Hannah", "Kwame", "Sofia", "Mateo", "Leila", "Tariq", "Ingrid", "Ravi", "Elena", "Jamal", "Yuki",
                "Bruno")
UNSEEN_ASKS = {
    "late": "Still nothing for parcel #{order}, which should have come last week",
    "damaged": "The box for #{order} showed up crushed and the contents are broken",
    "refund": "Please send my money back for purchase #{order}",
    "address": "We moved, so purchase #{order} needs to go to a different street",
}
"""The customer's side of each issue (`ISSUES`' keys) in the unseen phrasings."""


@dataclass(frozen=True)
class Customer:
    name: str
    order: str
    issue: str


@dataclass(frozen=True)
class StyleRule:
    name: str
    check: Callable[[str, Customer], bool]


def _greets(reply: str, c: Customer) -> bool:
    first = reply.strip().splitlines()[0] if reply.strip() else ""
    return re.match(rf"^(Hi|Hello|Dear) {re.escape(c.name)}\b", first) is not None


def _mentions_order(reply: str, c: Customer) -> bool:
    return f"#{c.order}" in reply


def _signs_off(reply: str, c: Customer) -> bool:
    return reply.rstrip().endswith(SIGN_OFF)


RULES = (StyleRule("greets_by_name", _greets), StyleRule("mentions_order", _mentions_order),
         StyleRule("signs_off", _signs_off))


def styled_reply(customer: Customer) -> str:
    body = ISSUES[customer.issue][1].format(order=customer.order)
    return f"Hi {customer.name},\n{body}\n{SIGN_OFF}"


class SupportEnv(TaskEnv):
    name = "support"

    def __init__(self, rules: tuple[StyleRule, ...] = RULES, difficulties: tuple[Difficulty, ...] = DIFFICULTIES):
        super().__init__(difficulties)
        if not rules:
            raise ValueError("SupportEnv needs at least one style rule")
        self.rules = rules

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        c = Customer(rng.choice(NAMES), str(rng.randint(1000, 9999)), rng.choice(sorted(ISSUES)))
        ask = ISSUES[c.issue][0].format(order=c.order)
        text = {
            "easy": f"{c.name}: {ask}.",
            "medium": f"{c.name}: hello, {ask}. Please help!",
            "hard": f"{c.name}: I called {rng.randint(2, 9)} times already and {ask}. Fix it today.",
        }[difficulty]
        return self._problem(difficulty, text, c)

    def _make_unseen(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        c = Customer(rng.choice(UNSEEN_NAMES), str(rng.randint(1000, 9999)), rng.choice(sorted(ISSUES)))
        ask = UNSEEN_ASKS[c.issue].format(order=c.order)
        text = {
            "easy": f"{ask}. — {c.name}",
            "medium": f"Good morning! {ask}. Could you sort it out? Thanks, {c.name}",
            "hard": f"Message number {rng.randint(2, 9)} about this! {ask}. Answer me now. — {c.name}",
        }[difficulty]
        return self._problem(difficulty, text, c)

    def _problem(self, difficulty: Difficulty, text: str, c: Customer) -> Problem:
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": text})
        return Problem(self.name, difficulty, text, messages, c,
                       ({"role": "assistant", "content": styled_reply(c)},))

    def rules_met(self, problem: Problem, answer: str | None) -> dict[str, bool]:
        return {r.name: answer is not None and r.check(answer, problem.expected) for r in self.rules}

    def reward(self, problem: Problem, answer: str | None) -> float:
        met = self.rules_met(problem, answer)
        return sum(met.values()) / len(met)

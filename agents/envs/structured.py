"""Structured output: extract fields from a short order note into a JSON object with
exactly the keys asked for.

Reward: 0.0 unless the reply is one JSON object (nothing around it); otherwise the share
of right fields over the union of asked and given keys, so a missing or an extra key
costs as much as a wrong value and 1.0 means exact keys with right values. Strings
compare case-insensitively after trimming; numbers numerically ("3" counts for 3).
The correction is the right JSON, compact: `{"name": "Dana Lee", "city": "Oslo"}`.

Difficulties ask for more keys: easy name+city, medium +quantity, hard +item with a
distractor number in the text. Traffic asks for the keys in that order, about notes shaped
"Dana Lee orders 3 mugs, ship to Oslo."; the unseen held-out set asks for the same keys in
another order, about other people, places and products in other note shapes
("Deliver to Bergen: 3 kettles, ordered by Lena Novak."), with the same reward.
"""

from __future__ import annotations

import json
import random
from typing import Any

from clora.agents.envs.base import Difficulty, Problem, TaskEnv

SYSTEM = "Reply with only a JSON object."

FIRST = ("Dana", "Ravi", "Sofia", "Ken", "Amara", "Jonas", "Mei", "Pablo", "Nora", "Yusuf")
LAST = ("Lee", "Shah", "Rossi", "Ito", "Okafor", "Berg", "Chen", "Ruiz", "Smith", "Kaya")
CITIES = ("Oslo", "Lima", "Pune", "Kyoto", "Lagos", "Porto", "Quito", "Hanoi", "Dublin", "Austin")
ITEMS = ("mugs", "lamps", "chairs", "books", "plates", "towels", "pens", "rugs")
KEYS = {"easy": ("name", "city"), "medium": ("name", "city", "quantity"), "hard": ("name", "city", "quantity", "item")}
UNSEEN_FIRST = ("Lena", "Tomas", "Aisha", "Hugo", "Ines", "Kai", "Zara", "Felix", "Rosa", "Idris")
UNSEEN_LAST = ("Novak", "Mensah", "Larsen", "Dubois", "Tanaka", "Silva", "Haddad", "Moreau", "Kowal", "Eriksen")
UNSEEN_CITIES = ("Bergen", "Cusco", "Nagpur", "Sapporo", "Accra", "Braga", "Cuenca", "Hue", "Galway", "Denver")
UNSEEN_ITEMS = ("kettles", "vases", "stools", "maps", "bowls", "blankets", "candles", "mats")
UNSEEN_KEYS = {"easy": ("city", "name"), "medium": ("quantity", "name", "city"),
               "hard": ("item", "city", "quantity", "name")}


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        if isinstance(got, bool):
            return False
        try:
            return float(got) == float(want)
        except (TypeError, ValueError):
            return False
    return isinstance(got, str) and got.strip().casefold() == str(want).casefold()


def field_scores(expected: dict[str, Any], answer: str | None) -> dict[str, bool] | None:
    """Per-key correctness over asked ∪ given keys; None when `answer` is not one JSON object."""
    if answer is None:
        return None
    try:
        got = json.loads(answer.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(got, dict):
        return None
    keys = [*expected, *sorted(set(got) - set(expected))]
    return {k: k in expected and k in got and _same(got[k], expected[k]) for k in keys}


class StructuredEnv(TaskEnv):
    name = "structured"

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        fields = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "city": rng.choice(CITIES),
                  "quantity": rng.randint(2, 40), "item": rng.choice(ITEMS)}
        keys = KEYS[difficulty]
        note = {
            "easy": f"Order from {fields['name']}, ship to {fields['city']}.",
            "medium": f"{fields['name']} orders {fields['quantity']} {fields['item']}, ship to {fields['city']}.",
            "hard": f"Ticket {rng.randint(100, 999)}: {fields['name']} wants {fields['quantity']} {fields['item']} "
                    f"sent to {fields['city']}.",
        }[difficulty]
        return self._problem(difficulty, keys, note, fields)

    def _make_unseen(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        fields = {"name": f"{rng.choice(UNSEEN_FIRST)} {rng.choice(UNSEEN_LAST)}", "city": rng.choice(UNSEEN_CITIES),
                  "quantity": rng.randint(2, 40), "item": rng.choice(UNSEEN_ITEMS)}
        note = {
            "easy": f"Deliver to {fields['city']}; the buyer is {fields['name']}.",
            "medium": f"Deliver to {fields['city']}: {fields['quantity']} {fields['item']}, ordered by "
                      f"{fields['name']}.",
            "hard": f"Invoice {rng.randint(100, 999)} lists {fields['quantity']} {fields['item']} for "
                    f"{fields['name']}, who lives in {fields['city']}.",
        }[difficulty]
        return self._problem(difficulty, UNSEEN_KEYS[difficulty], note, fields)

    def _problem(self, difficulty: Difficulty, keys: tuple[str, ...], note: str, fields: dict[str, Any]) -> Problem:
        text = f"Keys: {', '.join(keys)}.\nText: {note}"
        expected = {k: fields[k] for k in keys}
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": text})
        reference = ({"role": "assistant", "content": json.dumps(expected)},)
        return Problem(self.name, difficulty, text, messages, expected, reference)

    def reward(self, problem: Problem, answer: str | None) -> float:
        scores = field_scores(problem.expected, answer)
        if not scores:
            return 0.0
        return sum(scores.values()) / len(scores)

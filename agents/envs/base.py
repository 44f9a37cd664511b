"""What every environment shares: the `Problem` record, the `Environment` protocol, and
`TaskEnv`, which derives a seeded training stream and fixed held-out sets from its
problem makers so training and evaluation never overlap.

A problem's identity is its `key` (the user-visible text). Problems come in two phrasing
families (`Family`):

- `same`: the sentence templates, names and items traffic uses. The training stream is
  only ever this family; its held-out set is made once from `HELD_OUT_SEED`, and training
  problems whose key is held out are skipped, so evaluation never sees a problem trained on.
- `unseen`: the same operations and rules, the same reward, in other sentence shapes with
  other names and items, which traffic never uses (`_make_unseen`). A held-out score of
  1.00 on `same` and much less on `unseen` means the templates were learned, not the skill.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

from clora.agents.tools import ToolRegistry

Difficulty = Literal["easy", "medium", "hard"]
DIFFICULTIES: tuple[Difficulty, ...] = ("easy", "medium", "hard")

Family = Literal["same", "unseen"]
FAMILIES: tuple[Family, ...] = ("same", "unseen")
"""Phrasing families: `same` is the traffic's templates, `unseen` phrasings traffic never uses."""

HELD_OUT_SEED = 1_000_003
"""Seed of every environment's held-out sets (training seeds may be anything)."""


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Example (arithmetic): key "Sam has 4 bags of 7 apples. How many apples?",
    messages [system, user], expected 28, reference [assistant calls calculator("4*7"),
    tool "28", assistant calls final_answer(28)].
    """

    env: str
    difficulty: Difficulty
    key: str
    messages: tuple[dict[str, Any], ...]
    """The prompt, OpenAI-shaped."""
    expected: Any
    """What the reward compares against (a number, a dict of fields, a customer record)."""
    reference: tuple[dict[str, Any], ...]
    """A correct continuation of `messages`: assistant turns (and tool results between them)."""
    family: Family = "same"
    """Which phrasings the text uses: the traffic's templates (`same`) or others (`unseen`)."""


@runtime_checkable
class Environment(Protocol):
    name: str
    tools: ToolRegistry

    def problem(self, seed: int, difficulty: Difficulty, family: Family = "same") -> Problem: ...

    def train_problems(self, n: int, seed: int, difficulty: Difficulty | None = None) -> list[Problem]: ...

    def held_out(self, family: Family = "same") -> list[Problem]: ...

    def reward(self, problem: Problem, answer: str | None) -> float: ...

    def correction(self, problem: Problem, prompt: list[dict[str, Any]]) -> dict[str, Any]: ...


class TaskEnv:
    """Base for environments: subclasses define `name`, `tools`, `_make` (the traffic's
    phrasings), `_make_unseen` (other phrasings of the same tasks), `reward`, and (when it is
    not simply the reference's first assistant message) `correction`."""

    name: str = "task"
    tools: ToolRegistry = ToolRegistry()
    held_out_size: int = 30

    def __init__(self, difficulties: tuple[Difficulty, ...] = DIFFICULTIES) -> None:
        if not difficulties or any(d not in DIFFICULTIES for d in difficulties):
            raise ValueError(f"{self.name}: difficulties must be a non-empty subset of {DIFFICULTIES}, "
                             f"got {difficulties!r}")
        self.difficulties = tuple(difficulties)
        """The difficulties this instance draws from (training problems and the held-out sets)."""
        self._held_out: dict[Family, list[Problem]] = {}

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        """A problem in the traffic's phrasings."""
        raise NotImplementedError

    def _make_unseen(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        """A problem of the same kind in phrasings `_make` never produces."""
        raise NotImplementedError(f"{self.name}: this environment has no unseen phrasings")

    def problem(self, seed: int, difficulty: Difficulty, family: Family = "same") -> Problem:
        """The problem for (seed, difficulty, family): the same on every call and every machine."""
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"{self.name}: difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        if family == "same":
            return self._make(random.Random(f"{self.name}/{difficulty}/{seed}"), difficulty)
        if family == "unseen":
            p = self._make_unseen(random.Random(f"{self.name}/unseen/{difficulty}/{seed}"), difficulty)
            return replace(p, family="unseen")
        raise ValueError(f"{self.name}: family must be one of {FAMILIES}, got {family!r}")

    def held_out(self, family: Family = "same") -> list[Problem]:
        """A fixed evaluation set: `held_out_size` distinct problems of `family`, the instance's
        difficulties in turn. `same` shares the traffic's templates (and is kept out of training);
        `unseen` is phrased as traffic never is."""
        if family not in self._held_out:
            out: dict[str, Problem] = {}
            i = 0
            while len(out) < self.held_out_size:
                p = self.problem(HELD_OUT_SEED + i, self.difficulties[len(out) % len(self.difficulties)], family)
                out.setdefault(p.key, p)
                i += 1
                if i > 100 * self.held_out_size:
                    raise RuntimeError(f"{self.name}: cannot find {self.held_out_size} distinct {family} "
                                       "held-out problems")
            self._held_out[family] = list(out.values())
        return list(self._held_out[family])

    def train_problems(self, n: int, seed: int, difficulty: Difficulty | None = None) -> list[Problem]:
        """`n` training problems drawn from `seed`, none of them held out (difficulty None: any of
        the instance's difficulties)."""
        held = {p.key for p in self.held_out()}
        rng = random.Random(f"{self.name}/train/{seed}")
        out: list[Problem] = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 100 * n + 100:
                raise RuntimeError(f"{self.name}: only {len(out)} of {n} training problems avoid the held-out set")
            p = self.problem(rng.randrange(2**62), difficulty or rng.choice(self.difficulties))
            if p.key not in held:
                out.append(p)
        return out

    def reward(self, problem: Problem, answer: str | None) -> float:
        raise NotImplementedError

    def correction(self, problem: Problem, prompt: list[dict[str, Any]]) -> dict[str, Any]:
        """The assistant message that should follow `prompt` (an operator's correction)."""
        return dict(problem.reference[0])

    # --- conversations (environments whose episodes have state or a user who answers) ------

    max_turns: int | None = None
    """Model calls an episode needs at most, when the environment knows (None: the agent's own)."""

    def session(self, problem: Problem) -> Any | None:
        """A fresh conversation for `problem`: an object with `tools` (a `ToolRegistry` bound
        to the episode's own state), `reply(text)` (the user's answer to a plain reply of the
        agent; None ends the episode) and `fork()` (a fresh copy). None: the episode is the
        agent and the stateless `tools` alone, and a plain reply ends it."""
        return None

    def score(self, problem: Problem, trace: Any) -> float:
        """The reward of a whole episode (an `EpisodeTrace`): by default, of its answer."""
        return self.reward(problem, trace.answer)

    def breakdown(self, problem: Problem, messages: list[dict[str, Any]]) -> dict[str, float]:
        """Per-rule results of a whole conversation, for reports; {} when the reward has no rules."""
        return {}

    def follow(self, problem: Problem, prompt: list[dict[str, Any]],
               message: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The messages that follow `message` after `prompt` on a path an operator walks: the
        results of its tool calls; None when the path ends there (a plain reply, a final tool)."""
        calls = message.get("tool_calls") or []
        if not calls:
            return None
        results = []
        for call in calls:
            fn = call["function"]
            if self.tools.get(fn["name"]).final:
                return None
            results.append({"role": "tool", "tool_call_id": call["id"],
                            "content": self.tools.call(fn["name"], fn.get("arguments") or "")})
        return results

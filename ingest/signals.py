"""What served replies say about the adapter version that served them, rewards aside: the
reward-hacking guard's evidence (`clora.learner.hacking_guard`).

`ReplyTraits.of` reads one served interaction; the ingest worker stores it with the
interaction, once (`ReplayBuffer.store_interaction`), adding it to its version's running
totals. `ServedSignals` is one version's totals as the buffer returns them
(`ReplayBuffer.served_signals`), with the rates the guard compares.

A reply is *empty* when it has no tool call and its text is blank. A tool call is
*unparseable* when its arguments are not a JSON object. A reply's *length* is its characters
(text plus each tool call's name and arguments). Its *fingerprint* is a hash of its text
lower-cased with whitespace collapsed (tool calls included), and its *prompt fingerprint* the
same of the messages it answered; each is counted into a HyperLogLog per version.

The version's answer diversity is distinct replies per distinct prompt (at most 1): replies
that no longer depend on the question. Not per reply: RL sends each prompt to a group of
episodes, and a policy that learned the task answers a group's episodes alike, so distinct
replies per reply fell as it learned, and the guard rolled real learning back (`clora bench
experiments --preset learn`: 0.73 -> 0.25 over a version whose reward rose 0.29 -> 0.81).
Diversity is measured over a version's first `DIVERSITY_WINDOW` replies only, so versions that
served for different lengths of time compare on equal footing (distinct answers grow slower
than replies).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from clora.ingest.schemas import InteractionEvent

DIVERSITY_WINDOW = 64
"""Replies per version whose fingerprints count towards its diversity (its first ones)."""
_SPACE = re.compile(r"\s+")


def sample_variance(n: int, total: float, squares: float) -> float:
    """The sample variance (n - 1 in the denominator) of n values from their sum and sum of
    squares; 0 for fewer than two. Example: 1, 2, 3 -> (14 - 36 / 3) / 2 = 1.0."""
    if n < 2:
        return 0.0
    return max(0.0, (squares - total * total / n) / (n - 1))


@dataclass(frozen=True)
class ReplyTraits:
    """One served reply. Example: v3 answered "  OK " -> `ReplyTraits(version=3, empty=False,
    tool_call=False, bad_tool_call=False, length=5, fingerprint="9a0c...")`; a call
    `calculator({"expression": "17*3"` (cut short) -> `tool_call=True, bad_tool_call=True`."""

    version: int | None
    """The adapter version that served it (None: the base model)."""
    empty: bool
    tool_call: bool
    """It calls at least one tool."""
    bad_tool_call: bool
    """At least one of its tool calls has arguments that are not a JSON object."""
    length: int
    fingerprint: str
    """16 hex digits of a hash of the normalised reply."""
    prompt_fingerprint: str = ""
    """The same of the messages it answered ('' where unknown: the reply's count stands in)."""

    @staticmethod
    def of(ix: InteractionEvent) -> ReplyTraits:
        r = ix.response
        text = r.content or ""
        calls = r.tool_calls or []
        rendered = " ".join([text, *(f"{c.function.name}({c.function.arguments})" for c in calls)])
        return ReplyTraits(version=ix.adapter_version, empty=not calls and not text.strip(), tool_call=bool(calls),
                           bad_tool_call=any(not _json_object(c.function.arguments) for c in calls),
                           length=len(text) + sum(len(c.function.name) + len(c.function.arguments) for c in calls),
                           fingerprint=_fingerprint(rendered),
                           prompt_fingerprint=_fingerprint("\n".join(_rendered(m) for m in ix.messages)))


def _rendered(message) -> str:
    calls = message.tool_calls or []
    return " ".join([message.role, message.content or "", *(f"{c.function.name}({c.function.arguments})"
                                                              for c in calls)])


def _fingerprint(text: str) -> str:
    """16 hex digits of a hash of `text` lower-cased with whitespace collapsed."""
    return hashlib.blake2b(_SPACE.sub(" ", text).strip().lower().encode(), digest_size=8).hexdigest()


def _json_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


@dataclass(frozen=True)
class ServedSignals:
    """One version's served replies. Example: 40 replies, 2 empty, 30 calling tools (1 with
    unparseable arguments), 2,400 characters in all (sum of squares 180,000), 38 distinct among
    them: `ServedSignals(n=40, empty=2, tool_calls=30, bad_tool_calls=1, chars=2400,
    chars_sq=180000, distinct=38)` -> empty rate 0.05, mean length 60.0, diversity 0.95."""

    n: int
    empty: int
    tool_calls: int
    bad_tool_calls: int
    chars: int
    chars_sq: int
    distinct: int
    """Distinct fingerprints among the first `DIVERSITY_WINDOW` replies (a HyperLogLog's
    estimate: exact in practice at these counts)."""
    prompts: int = 0
    """Distinct prompt fingerprints among the same replies (0: not recorded, as before replies
    carried them)."""

    @property
    def empty_rate(self) -> float:
        return self.empty / self.n

    @property
    def bad_tool_call_rate(self) -> float:
        """Replies with an unparseable tool call, as a share of all replies."""
        return self.bad_tool_calls / self.n

    @property
    def mean_length(self) -> float:
        return self.chars / self.n

    @property
    def length_variance(self) -> float:
        """Sample variance of the reply length (0 for a single reply)."""
        return sample_variance(self.n, self.chars, self.chars_sq)

    @property
    def diversity(self) -> float:
        """Distinct replies per distinct prompt among the first `DIVERSITY_WINDOW` replies, at
        most 1.0 (each prompt answered its own way); per reply where prompts were not recorded."""
        return min(1.0, self.distinct / (self.prompts or min(self.n, DIVERSITY_WINDOW)))

    def summary(self) -> dict[str, float | int]:
        """JSON-able numbers for the console and a guard's notes."""
        return {"replies": self.n, "empty_rate": round(self.empty_rate, 4),
                "bad_tool_call_rate": round(self.bad_tool_call_rate, 4), "mean_length": round(self.mean_length, 1),
                "diversity": round(self.diversity, 4)}

"""Builders for the usual kinds of feedback, each a `FeedbackRecord` the webhook accepts. What
each trains is the platform's rule (the tenant's reward spec maps a `key`'s scores to rewards):

| builder      | record                                   | trains                                  |
|--------------|------------------------------------------|-----------------------------------------|
| `thumbs`     | `key="thumbs"`, score 1 or 0             | RL, when the spec has a `bool` key      |
| `rating`     | `key="rating"`, an integer score         | RL, when the spec has a `scale` key     |
| `reward`     | a score (`key` optional)                 | RL (no spec: every score is a reward)   |
| `correction` | the answer as it should have been        | SFT on it, and a preference pair        |
| `preference` | the answer preferred to the served one   | the same as `correction`                |
| `comment`    | text only                                | nothing; shown in the console           |

`interaction` is an interaction id or the `openai` client's response object (one choice; for
several, pass `interaction_id(response, i)`).
"""

from __future__ import annotations

from typing import Any

from clora_client.ids import interaction_id
from clora_client.models import FeedbackRecord, FeedbackSource, Message, to_record


def _record(interaction: Any, **fields: Any) -> FeedbackRecord:
    fields = {k: v for k, v in fields.items() if v is not None}
    return to_record({"interaction_id": interaction_id(interaction), **fields})


def thumbs(interaction: Any, up: bool, *, key: str = "thumbs", source: FeedbackSource = "user",
           comment: str | None = None, event_id: str | None = None) -> FeedbackRecord:
    """A thumbs-up (score 1) or thumbs-down (score 0)."""
    return _record(interaction, key=key, score=1.0 if up else 0.0, source=source, comment=comment,
                   event_id=event_id)


def rating(interaction: Any, value: int, *, key: str = "rating", source: FeedbackSource = "user",
           comment: str | None = None, event_id: str | None = None) -> FeedbackRecord:
    """A rating on the integer scale the tenant's reward spec gives `key` (1-5 stars, say)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a rating is an integer, not {value!r}")
    return _record(interaction, key=key, score=float(value), source=source, comment=comment, event_id=event_id)


def reward(interaction: Any, value: float, *, key: str | None = None, source: FeedbackSource = "environment",
           comment: str | None = None, event_id: str | None = None) -> FeedbackRecord:
    """A reward (1.0 = correct), as an environment or a judge scores an answer."""
    return _record(interaction, key=key, score=value, source=source, comment=comment, event_id=event_id)


def correction(interaction: Any, answer: str | Message | dict[str, Any], *, source: FeedbackSource = "operator",
               score: float | None = None, comment: str | None = None,
               event_id: str | None = None) -> FeedbackRecord:
    """The answer as it should have been: text, or an assistant `Message` (tool calls included)."""
    message = {"role": "assistant", "content": answer} if isinstance(answer, str) else answer
    return _record(interaction, correction=message, source=source, score=score, comment=comment,
                   event_id=event_id)


def preference(interaction: Any, chosen: str | Message | dict[str, Any], *, source: FeedbackSource = "user",
               comment: str | None = None, event_id: str | None = None) -> FeedbackRecord:
    """`chosen` is preferred to the answer served: the platform pairs them (chosen > served) and
    also learns `chosen` as the answer. The record is a correction."""
    return correction(interaction, chosen, source=source, comment=comment, event_id=event_id)


def comment(interaction: Any, text: str, *, source: FeedbackSource = "user", key: str | None = None,
            event_id: str | None = None) -> FeedbackRecord:
    """A comment, kept with the tenant's recent feedback; it trains nothing."""
    return _record(interaction, comment=text, source=source, key=key, event_id=event_id)

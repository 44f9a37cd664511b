"""Ids: the event ids that make retries idempotent, and the interaction ids that join feedback
to what the gateway served through the `openai` client.

The gateway records a response with one choice under the response's `id`, and a response with
n > 1 choices as one interaction per choice, `{id}-0` ... `{id}-{n-1}`; feedback names one of
those. `interaction_id` reads them off the `openai` client's objects (a `ChatCompletion`, a
`Completion`, a `Response`, or their `model_dump()`), duck-typed: this SDK does not depend on
`openai`.

    completion = openai_client.chat.completions.create(model="acme", messages=..., n=3)
    interaction_id(completion, 2)           # "chatcmpl-...-2"
    interaction_id(completion, completion.choices[2])   # the same, by the choice's .index
    interaction_id("chatcmpl-abc")          # "chatcmpl-abc" (a response with one choice)
    interaction_id("chatcmpl-abc", 1)       # "chatcmpl-abc-1" (choice 1 of several)
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any


def new_event_id() -> str:
    """A fresh event id, `fb-{32 hex digits}`, the shape the platform's own ids have."""
    return f"fb-{uuid.uuid4().hex}"


def choice_ids(response_id: str, n: int) -> list[str]:
    """The interaction ids of a response's `n` choices: `["chatcmpl-1"]` for n = 1,
    `["chatcmpl-1-0", "chatcmpl-1-1", ...]` for more."""
    if n < 1:
        raise ValueError(f"a response has at least one choice, not {n}")
    return [response_id] if n == 1 else [f"{response_id}-{i}" for i in range(n)]


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _response_id(response: Any) -> str:
    rid = response if isinstance(response, str) else _get(response, "id")
    if not isinstance(rid, str) or not rid:
        raise TypeError(f"expected a response id or an object with an `id` (an openai ChatCompletion, "
                        f"Completion or Response), not {type(response).__name__}")
    return rid


def _index(choice: Any) -> int:
    index = choice if isinstance(choice, int) else _get(choice, "index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a choice is a non-negative index or an object with one (`.index`), not {choice!r}")
    return index


def interaction_ids(response: Any) -> list[str]:
    """Every interaction id the gateway recorded for `response` (an object with `id` and, for
    chat and text completions, `choices`), one per choice in index order."""
    choices = _get(response, "choices")
    return choice_ids(_response_id(response), len(choices) if choices else 1)


def interaction_id(response: Any, choice: Any = None, *, n: int | None = None) -> str:
    """The interaction id feedback on `response`'s `choice` names.

    `response` is the `openai` client's object (or its dict), or a response id. `choice` is an
    index or a choice object (its `.index`); it may be left out when the response has one choice.
    `n`, the number of choices the request asked for, defaults to the object's `len(choices)`;
    with a bare id, a `choice` means the response had several (pass `n=1` for choice 0 of one).
    """
    rid = _response_id(response)
    if n is None and not isinstance(response, str):
        choices = _get(response, "choices")
        n = len(choices) if choices else 1
    if choice is None:
        if n is not None and n > 1:
            raise ValueError(f"response {rid} has {n} choices, each its own interaction: name one "
                             f"({', '.join(choice_ids(rid, n)[:3])}{', ...' if n > 3 else ''})")
        return rid
    index = _index(choice)
    if n is None:
        return f"{rid}-{index}"
    if index >= n:
        raise ValueError(f"choice {index} is out of range for response {rid} with {n} choice(s)")
    return choice_ids(rid, n)[index]

"""Ids every part shares: tenant ids, event ids, the served name of an adapter version and the
interaction ids of a response's choices.

A tenant id is a short slug, because it appears in Redis keys, adapter folders, served names
and URLs. An adapter version is served under one name, `{tenant}@v{version}` (`acme@v7`);
`served_name` builds it and `parse_served_name` reads it back, and nothing else spells it.
A response with n > 1 choices is one response `id` whose choices are recorded, and take
feedback, as `{id}-0` ... `{id}-{n-1}` (`choice_ids`). The gateway names its responses as
OpenAI does, `chatcmpl-{32 hex digits}`, `cmpl-{32 hex digits}` or `resp_{32 hex digits}`
(`new_response_id`), and
`GATEWAY_INTERACTION_ID_RE` recognises them and their choices: feedback on an id of that shape
that the gateway never served is refused, while other ids (clients that record interactions
themselves) wait for theirs.

Every pattern here is matched whole (`fullmatch`): `^...$` would let a final newline through,
since Python's `$` also matches before one.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated, Literal

from pydantic import Field

TENANT_ID_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"
TENANT_ID_RE = re.compile(TENANT_ID_PATTERN)
"""Tenant ids are short slugs: they appear in Redis keys, adapter names and URLs (`fullmatch`)."""

SERVED_NAME_RE = re.compile(rf"(?P<tenant>{TENANT_ID_PATTERN})@v(?P<version>[0-9]{{1,9}})")
"""`{tenant}@v{version}` (`fullmatch`); `[0-9]`, because `\\d` also matches other scripts' digits."""

RESERVED_TENANT_IDS = frozenset({"base"})
"""Model names the gateway gives a meaning of their own, so no tenant may be called one: a
tenant's model name is its id, and `base` (the default `CLORA_ENGINE_BASE_NAME`) names the
frozen base model. A platform serving the base model under another name reserves that name too
(`Registry(reserved_ids=...)`)."""

Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]
"""An event, interaction or feedback id as clients may send it. pydantic-core matches `pattern`
with Rust's regex engine, whose `$` is the end of the text: a final newline is refused."""


def new_id(prefix: str = "ev") -> str:
    """A fresh random id, `{prefix}-{32 hex digits}`."""
    return f"{prefix}-{uuid.uuid4().hex}"


RESPONSE_ID_PREFIXES: dict[str, str] = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}
"""The prefix of the gateway's response ids, by route kind: chat completions, text completions,
the Responses API."""

GATEWAY_INTERACTION_ID_RE = re.compile(r"(?:chatcmpl-|cmpl-|resp_)[0-9a-f]{32}(?:-(?:0|[1-9][0-9]{0,8}))?")
"""An id the gateway minted (`new_response_id`), or one choice of it (`choice_ids`):
`chatcmpl-0123...ef`, `cmpl-0123...ef-2`, `resp_0123...ef` (`fullmatch`)."""


def new_response_id(kind: Literal["chat", "completion", "responses"]) -> str:
    """A fresh id for a response the gateway serves, shaped as OpenAI's: `chatcmpl-{32 hex}` for a
    chat completion, `cmpl-{32 hex}` for a text completion, `resp_{32 hex}` for a Responses API
    response."""
    return RESPONSE_ID_PREFIXES[kind] + uuid.uuid4().hex


def is_gateway_interaction_id(interaction_id: str) -> bool:
    """Whether `interaction_id` has the shape of an id the gateway mints (`new_response_id`) or of
    one of its choices: `is_gateway_interaction_id(new_response_id("chat") + "-1")` is True,
    `is_gateway_interaction_id("my-app-42")` False."""
    return GATEWAY_INTERACTION_ID_RE.fullmatch(interaction_id) is not None


def derived_id(prefix: str, *parts: str) -> str:
    """The id the same `parts` always give, shaped like `new_id`'s: `{prefix}-{32 hex digits}`
    of their SHA-256. The webhook names the events of a signed request without `event_id`s by
    its signature and each record's index, so a replayed request gets the ids it got before."""
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()
    return f"{prefix}-{digest[:32]}"


def validate_tenant_id(value: str) -> str:
    """`value` if it is a tenant id, else ValueError saying what one looks like."""
    if not isinstance(value, str) or not TENANT_ID_RE.fullmatch(value):
        raise ValueError("tenant id must be 1-63 chars of a-z, 0-9, '_' or '-', starting with a letter or digit")
    return value


def served_name(tenant: str, version: int) -> str:
    """The name vLLM and the OpenAI API know one adapter version by: `served_name("acme", 7)`
    is `"acme@v7"`."""
    return f"{tenant}@v{version}"


def parse_served_name(model: str) -> tuple[str, int | None]:
    """A `model` field as a client sends it: `"acme"` -> ("acme", None) (the live version);
    `"acme@v7"` -> ("acme", 7) (that version, pinned)."""
    m = SERVED_NAME_RE.fullmatch(model)
    if m:
        return m["tenant"], int(m["version"])
    return model, None


def choice_ids(response_id: str, n: int) -> list[str]:
    """The interaction ids of a response's `n` choices, which feedback names:
    `choice_ids("chatcmpl-1", 1)` is `["chatcmpl-1"]`, `choice_ids("chatcmpl-1", 3)` is
    `["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]`."""
    return [response_id] if n == 1 else [f"{response_id}-{i}" for i in range(n)]

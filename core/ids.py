"""Ids every part shares: tenant ids, event ids and the served name of an adapter version.

A tenant id is a short slug, because it appears in Redis keys, adapter folders, served names
and URLs. An adapter version is served under one name, `{tenant}@v{version}` (`acme@v7`);
`served_name` builds it and `parse_served_name` reads it back, and nothing else spells it.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated

from pydantic import Field

TENANT_ID_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"
TENANT_ID_RE = re.compile(rf"^{TENANT_ID_PATTERN}$")
"""Tenant ids are short slugs: they appear in Redis keys, adapter names and URLs."""

SERVED_NAME_RE = re.compile(rf"^(?P<tenant>{TENANT_ID_PATTERN})@v(?P<version>\d{{1,9}})$")

Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]
"""An event, interaction or feedback id as clients may send it."""


def new_id(prefix: str = "ev") -> str:
    """A fresh random id, `{prefix}-{32 hex digits}`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def validate_tenant_id(value: str) -> str:
    """`value` if it is a tenant id, else ValueError saying what one looks like."""
    if not TENANT_ID_RE.match(value):
        raise ValueError("tenant id must be 1-63 chars of a-z, 0-9, '_' or '-', starting with a letter or digit")
    return value


def served_name(tenant: str, version: int) -> str:
    """The name vLLM and the OpenAI API know one adapter version by: `served_name("acme", 7)`
    is `"acme@v7"`."""
    return f"{tenant}@v{version}"


def parse_served_name(model: str) -> tuple[str, int | None]:
    """A `model` field as a client sends it: `"acme"` -> ("acme", None) (the live version);
    `"acme@v7"` -> ("acme", 7) (that version, pinned)."""
    m = SERVED_NAME_RE.match(model)
    if m:
        return m["tenant"], int(m["version"])
    return model, None

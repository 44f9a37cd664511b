"""Tenant aliases: which adapter version a tenant's model name (`acme`) serves right now.

`AdapterRef` names one immutable adapter version; its served name in vLLM is
`{tenant}@v{version}` and its folder is never overwritten, so vLLM's prefix cache (keyed by
name and path) can never serve stale weights. `AliasTable.switch` replaces a tenant's live
ref in one assignment: a request resolves its ref once, at admission, and keeps it until it
finishes, so in-flight requests stay on the version they started with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PINNED_RE = re.compile(r"^(?P<tenant>[a-z0-9][a-z0-9_-]{0,62})@v(?P<version>\d{1,9})$")


@dataclass(frozen=True)
class AdapterRef:
    tenant: str
    version: int
    path: str

    @property
    def name(self) -> str:
        return f"{self.tenant}@v{self.version}"


def parse_model(model: str) -> tuple[str, int | None]:
    """`"acme"` -> ("acme", None); `"acme@v7"` -> ("acme", 7)."""
    m = PINNED_RE.match(model)
    if m:
        return m["tenant"], int(m["version"])
    return model, None


class AliasTable:
    """tenant -> live `AdapterRef`. Mutated only from the gateway's event loop."""

    def __init__(self) -> None:
        self._live: dict[str, AdapterRef] = {}

    def get(self, tenant: str) -> AdapterRef | None:
        return self._live.get(tenant)

    def switch(self, tenant: str, ref: AdapterRef | None) -> AdapterRef | None:
        """Point `tenant` at `ref` (None: no live adapter). Returns the previous ref."""
        old = self._live.get(tenant)
        if ref is None:
            self._live.pop(tenant, None)
        else:
            self._live[tenant] = ref
        return old

    def tenants(self) -> list[str]:
        return list(self._live)

    def refs(self) -> list[AdapterRef]:
        return list(self._live.values())

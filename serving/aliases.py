"""Tenant aliases: which adapter version a tenant's model name (`acme`) serves right now.

`AdapterRef` names one immutable adapter version; its served name in vLLM is
`clora.ids.served_name` (`acme@v7`) and its folder is never overwritten, so vLLM's prefix
cache (keyed by name and path) can never serve stale weights. `AliasTable.switch` replaces a
tenant's live ref in one assignment: a request resolves its ref once, at admission, and keeps
it until it finishes, so in-flight requests stay on the version they started with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clora.canary import AdapterCanary
from clora.ids import served_name
from clora.registry import AdapterVersion


@dataclass(frozen=True)
class AdapterRef:
    tenant: str
    version: int
    path: str
    canary: AdapterCanary | None = field(default=None, compare=False, repr=False)
    """What each replica must answer once it loaded this version (`clora.canary`); None: none published."""

    @classmethod
    def of(cls, tenant: str, av: AdapterVersion) -> "AdapterRef":
        """The ref of a version the registry recorded."""
        return cls(tenant, av.version, av.path, av.canary)

    @property
    def name(self) -> str:
        return served_name(self.tenant, self.version)


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

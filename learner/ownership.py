"""What a learner does as its tenants' leases come and go: `Ownership`.

The leases themselves (who holds which tenant, renewal, fair share) are `clora.learner.leases`;
this module acts on what they say, once per tick (`follow`) and whenever a write or a check
finds a lease gone (`let_go`):

- a tenant lost (another learner took it, or its lease lapsed) is dropped from memory and the
  device at once, unsaved: its new holder resumes from the newest checkpoint;
- a tenant beyond this learner's fair share is checkpointed, then dropped and released, so the
  learner that joined takes it at its next tick with nothing lost;
- for a tenant taken, the external work (Tinker runs) forgets what it knew of the tenant's runs
  while another learner ran them; the tenant itself is loaded from its newest checkpoint when
  the loop admits it (`TenantLifecycle.admit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping, Sequence

from clora.fencing import FencedOut
from clora.learner.external import ExternalWork
from clora.learner.leases import Leases
from clora.learner.lifecycle import TenantLifecycle
from clora.learner.tenant import LearnerTenant

log = logging.getLogger(__name__)


class Ownership:
    def __init__(self, leases: Leases, lifecycle: TenantLifecycle, tenants: MutableMapping[str, LearnerTenant],
                 external: Callable[[], ExternalWork | None]):
        self.leases = leases
        self.lifecycle = lifecycle
        self.tenants = tenants
        self.external = external
        """The learner's external work, when it has some (set after the learner is built)."""

    def follow(self, tenants: Sequence[str]) -> None:
        """The tick's lease work (`Leases.sync`) over the registry's `tenants`, acted on."""
        changes = self.leases.sync(tenants)
        for tid in changes.lost:
            self.let_go(tid, "its lease was taken over or lapsed")
        for tid in changes.surplus:
            try:
                if tid in self.lifecycle.store and self.tenants[tid].dirty:
                    self.lifecycle.checkpoint(tid)
            except FencedOut:
                pass                 # already someone else's: nothing to hand over
            except Exception as e:  # noqa: BLE001 - it stays ours this tick; handed back at a later one
                log.error("checkpointing %s to hand it back failed (kept for now): %s", tid, e)
                continue
            self.let_go(tid, "handed back: beyond this learner's fair share")
        if (external := self.external()) is not None:
            for tid in changes.gained:
                external.drop(tid)

    def check(self, tenant: str) -> bool:
        """Whether `tenant`'s lease still holds (checked with Redis, renewing every lease held);
        when it does not, the tenant is let go."""
        try:
            self.leases.check(tenant)
        except FencedOut as e:
            self.let_go(tenant, e)
            return False
        return True

    def let_go(self, tenant: str, why: BaseException | str) -> None:
        """Stop training `tenant` at once, unsaved: another learner holds (or may take) its lease."""
        log.warning("learner %s stops training %s: %s", self.leases.learner_id, tenant, why)
        self.leases.release([tenant])     # only where it still holds it
        self.lifecycle.drop(tenant)
        if (external := self.external()) is not None:
            external.drop(tenant)

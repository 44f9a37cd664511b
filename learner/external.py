"""Work from outside the replay buffers that the learner's scheduler shares out with its tenants.

    ExternalWork   what the loop asks of it: views to schedule, one unit of work, a wake-up wait

The Tinker-compatible training API (`clora.trainapi.executor.TinkerWork`) is one: each training
run with requests queued shows up as one more `TenantView`, weighted and prioritised as its
tenant is, and the scheduler picks it as it picks a tenant, so a research loop and the
continuously learning tenants share the device by the same rule. Each unit belongs to a tenant
(`owner`) and runs only on the learner that holds that tenant's lease. The learner never imports the
package above it; `clora learner` passes it in (`process.main(..., external=...)`).
"""

from __future__ import annotations

from typing import Protocol

from clora.learner.scheduler import TenantView


def metric_label(view_id: str) -> str:
    """The metric label of a view: a tenant's id as it is; external work's id, `owner/kind/name`
    (a Tinker run: `acme/tinker/<model id>`), as `owner/kind`, so that runs coming and going do
    not grow the label set. Example: metric_label("acme/tinker/9f:train:0") == "acme/tinker"."""
    return "/".join(view_id.split("/")[:2])


def owner(view_id: str) -> str:
    """The tenant a view belongs to: a tenant's id is its own; external work's `owner/kind/name`
    is its owner's (a Tinker run follows its tenant's lease). Example: owner("acme/tinker/9f") == "acme"."""
    return view_id.split("/", 1)[0]


class ExternalWork(Protocol):
    def views(self, registered: dict) -> list[TenantView]:
        """One view per unit of work that wants the device now; `registered` holds the registry's
        tenants by id (admitted this tick). Ids are `owner/kind/name` (`metric_label`), so they
        never collide with a tenant id, which holds no "/"."""

    def owns(self, key: str) -> bool:
        """Whether `key`, a picked view's id, is this work's."""

    def run(self, key: str) -> float | None:
        """Run one request of `key` on the learner's model and store; the seconds it took (the
        scheduler charges them), None when there was nothing to run."""

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` or until new work arrives (the loop's idle wait)."""

    def drop(self, tenant: str) -> None:
        """The learner lost `tenant`'s lease, handed it back or just took it: forget what it holds
        of the tenant's work in memory (it is read again from its checkpoints when needed)."""

    def close(self) -> None:
        """The learner stops: persist what must survive."""

"""Failed steps: the tenant waits before its next try while every other tenant trains on.

Owns `Backoff` (a tenant's failures in a row and when it may try again) and `StepFailures`,
which the loop calls when a tenant's step failed (a non-finite gradient, a full disk, an
unreadable folder...) and when one went through. A failure is logged and counted, the
gradients the step had accumulated are dropped, and the tenant waits 5 s, doubling with each
failure in a row up to 5 min. Its batch is not skipped: once the cause is fixed it trains on
that data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from clora.learner.lifecycle import TenantLifecycle
from clora.learner.metrics import LearnerMetrics, append_history
from clora.learner.tenant import LearnerTenant

log = logging.getLogger(__name__)

FIRST_WAIT_S = 5.0
MAX_WAIT_S = 300.0


@dataclass(frozen=True)
class Backoff:
    """Example: the third failure in a row at monotonic time 100.0 is
    `Backoff(failures=3, wait_s=20.0, retry_at=120.0)` (waits of 5, 10, 20 s, ... 300 s)."""

    failures: int
    """Failed steps in a row."""
    wait_s: float
    retry_at: float
    """Monotonic time before which the tenant is not offered to the scheduler."""

    @staticmethod
    def after(previous: Backoff | None, now: float) -> Backoff:
        """The back-off after one more failure, following `previous` (None: the first)."""
        n = (previous.failures if previous is not None else 0) + 1
        wait = min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** (n - 1))
        return Backoff(n, wait, now + wait)


class StepFailures:
    def __init__(self, tenants: MutableMapping[str, LearnerTenant], lifecycle: TenantLifecycle,
                 metrics: LearnerMetrics, registry):
        self.tenants = tenants
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.registry = registry

    def failed(self, tenants: Iterable[str], error: BaseException) -> None:
        """The step of `tenants` failed with `error`: each is counted, logged, cleared of the
        step's gradients and backed off (`Backoff.after`)."""
        for tid in tenants:
            record = self.tenants[tid]
            record.backoff = b = Backoff.after(record.backoff, time.monotonic())
            self.metrics.failures.labels(tid).inc()
            try:
                self.lifecycle.drop_grads(tid)
            except Exception:  # noqa: BLE001 - the state itself may be what failed
                log.exception("clearing %s's gradients after its failed step failed", tid)
            log.error("training %s failed (%d time(s) in a row; next try in %.0f s): %s", tid, b.failures, b.wait_s,
                      error, exc_info=error)
            append_history(self.registry, tid, {"failed": f"{type(error).__name__}: {error}"[:500],  # the console
                                                "failures": b.failures, "retry_in_s": b.wait_s})    # shows it

    def succeeded(self, tenant: str) -> None:
        """`tenant`'s step went through: its next failure starts the back-off afresh."""
        self.tenants[tenant].backoff = None

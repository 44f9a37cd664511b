"""The tenant scheduler: which tenant trains next.

Weighted fair share over training, in the style of stride scheduling. Each tenant has a
virtual time that advances by `charge / share` whenever it trains, where

    share = weight * (1 + log1p(min(waiting, full_backlog))) * 2 ** priority

(`waiting` = new examples since the tenant's cursor), and the eligible tenant with the
smallest virtual time goes next. So a tenant with twice the weight gets about twice the
training, more waiting data earns more (sub-linearly) up to `full_backlog` examples, priority
multiplies the share but never locks others out, and every eligible tenant is eventually picked
(no starvation; `max_wait_s` additionally forces a tenant that waited that long to the front).

Past `full_backlog` a backlog says only that the tenant wants more than its share: a tenant
offering 10x the examples of another does not earn more training for it (uncapped, its ever
growing backlog would: log1p(10000) / log1p(1000) keeps widening the gap as backlogs grow).

`charge` is what the step cost. A step recorded with its training `tokens` is charged those
tokens at the learner's running cost per token (`seconds_per_token`, an average over every
tenant's steps), so tenants share training tokens, as fairness is measured, while the charge
stays in seconds, comparable with work recorded by its time alone (external work, a step
recorded without tokens). Charged bare seconds, a tenant whose steps are small (a few examples
each, the fixed cost of a step dominating) would get fewer tokens for the same time.

Eligible = not paused and `waiting >= min_new_examples`. A tenant that newly appears (or
becomes eligible again) starts at the smallest current virtual time, so idling earns no
burst credit. Decisions are logged and counted in metrics.

Fused training (`pick_group`) takes up to K eligible tenants at once: repeatedly the one a
plain `pick` would choose next, so the group is the K smallest virtual times (starved
tenants first); each member is then charged its own share of the fused step (`record`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from clora.learner.metrics import LearnerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantView:
    """What the scheduler knows about a tenant at decision time.
    Example: TenantView("acme", paused=False, weight=2.0, priority=1, min_new_examples=8, waiting=30)."""

    id: str
    paused: bool
    weight: float
    priority: int
    min_new_examples: int
    waiting: int

    @property
    def eligible(self) -> bool:
        return not self.paused and self.waiting >= self.min_new_examples

    @property
    def share(self) -> float:
        """Its share with every waiting example counted (`Scheduler` caps them at `full_backlog`)."""
        return self.capped_share(None)

    def capped_share(self, full_backlog: int | None) -> float:
        waiting = self.waiting if full_backlog is None else min(self.waiting, full_backlog)
        return self.weight * (1.0 + math.log1p(waiting)) * 2.0 ** self.priority


@dataclass(frozen=True)
class Decision:
    """`tenant` None means nobody is eligible; `reason` says why the pick was made."""

    tenant: str | None
    reason: str
    skipped: dict[str, str] = field(default_factory=dict)
    """Tenants not eligible and why ("paused", "waiting 3 < 8")."""


@dataclass(frozen=True)
class GroupDecision:
    """Tenants for one fused step (empty: nobody eligible), in pick order.
    Example: GroupDecision(("acme", "beta"), "acme: fair share (...); beta: fair share (...)", {"idle": "paused"})."""

    tenants: tuple[str, ...]
    reason: str
    skipped: dict[str, str] = field(default_factory=dict)


FULL_BACKLOG = 64
"""Waiting examples past which more do not earn a larger share (eight batches of the default 8)."""


class Scheduler:
    def __init__(self, *, max_wait_s: float = 600.0, metrics: LearnerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, label: Callable[[str], str] = lambda view_id: view_id,
                 full_backlog: int | None = FULL_BACKLOG):
        """`full_backlog`: waiting examples past which a tenant's share stops growing (None:
        never: every extra example earns more)."""
        self.max_wait_s = max_wait_s
        self.full_backlog = full_backlog
        self.metrics = metrics
        self.label = label
        """A view's metric label: bounded however many views come and go (external work's)."""
        self.clock = clock
        self._vtime: dict[str, float] = {}
        self._share: dict[str, float] = {}
        self._eligible_since: dict[str, float] = {}
        self.step_seconds: dict[str, float] = {}
        """Exponential moving average of each tenant's step time."""
        self.seconds_per_token: float | None = None
        """Running cost of a training token over every tenant's steps recorded with their tokens."""

    def _eligible(self, views: list[TenantView]) -> tuple[list[TenantView], dict[str, str]]:
        eligible, skipped = [], {}
        for v in views:
            if v.paused:
                skipped[v.id] = "paused"
            elif v.waiting < v.min_new_examples:
                skipped[v.id] = f"waiting {v.waiting} < {v.min_new_examples}"
            else:
                eligible.append(v)
        now = self.clock()
        floor = min((self._vtime[v.id] for v in eligible if v.id in self._vtime and v.id in self._eligible_since),
                    default=0.0)
        for v in eligible:
            if v.id not in self._eligible_since:  # newly eligible: no credit for idle time
                self._eligible_since[v.id] = now
                self._vtime[v.id] = max(self._vtime.get(v.id, floor), floor)
        for t in skipped:
            self._eligible_since.pop(t, None)
        return eligible, skipped

    def _choose(self, eligible: list[TenantView], exclude: str | None = None) -> tuple[TenantView | None, str]:
        cands = [v for v in eligible if v.id != exclude]
        if not cands:
            return None, "nothing eligible"
        now = self.clock()
        starved = [v for v in cands if now - self._eligible_since[v.id] >= self.max_wait_s]
        if starved:
            v = min(starved, key=lambda v: self._eligible_since[v.id])
            return v, f"waited {now - self._eligible_since[v.id]:.0f}s >= max_wait_s"
        v = min(cands, key=lambda v: (self._vtime[v.id], -v.priority, v.id))
        return v, f"fair share (vtime {self._vtime[v.id]:.3f}, share {self._share_of(v):.2f})"

    def pick(self, views: list[TenantView]) -> Decision:
        eligible, skipped = self._eligible(views)
        chosen, reason = self._choose(eligible)
        if self.metrics is not None:
            for v in views:
                self.metrics.waiting.labels(self.label(v.id)).set(v.waiting)
            self.metrics.decisions.labels(self.label(chosen.id) if chosen else "", "pick" if chosen else "idle").inc()
        if chosen is None:
            log.debug("scheduler: idle (%s)", skipped)
            return Decision(None, reason, skipped)
        self._share[chosen.id] = self._share_of(chosen)
        log.info("scheduler: %s (%s); skipped %s", chosen.id, reason, skipped or "none")
        return Decision(chosen.id, reason, skipped)

    def pick_group(self, views: list[TenantView], k: int) -> "GroupDecision":
        """Up to `k` eligible tenants for one fused step, in the order `pick` would take them."""
        if k < 1:
            raise ValueError(f"pick_group needs k >= 1, got {k}")
        eligible, skipped = self._eligible(views)
        chosen, reasons = [], []
        while len(chosen) < k:
            v, reason = self._choose([e for e in eligible if e.id not in {c.id for c in chosen}])
            if v is None:
                break
            chosen.append(v)
            reasons.append(f"{v.id}: {reason}")
            self._share[v.id] = self._share_of(v)
        if self.metrics is not None:
            for v in views:
                self.metrics.waiting.labels(self.label(v.id)).set(v.waiting)
            for v in chosen:
                self.metrics.decisions.labels(self.label(v.id), "pick").inc()
            if not chosen:
                self.metrics.decisions.labels("", "idle").inc()
        if chosen:
            log.info("scheduler: fused group %s; skipped %s", reasons, skipped or "none")
        return GroupDecision(tuple(v.id for v in chosen), "; ".join(reasons) or "nothing eligible", skipped)

    def peek_next(self, views: list[TenantView], after: str) -> str | None:
        """The tenant likely to be picked after `after` trains (for prefetching), without
        changing any state."""
        eligible = [v for v in views if v.eligible and v.id in self._eligible_since]
        chosen, _ = self._choose(eligible, exclude=after)
        return chosen.id if chosen else None

    def _share_of(self, v: TenantView) -> float:
        return v.capped_share(self.full_backlog)

    def record(self, tenant: str, seconds: float, tokens: int | None = None) -> None:
        """Charge `tenant` for a step that took `seconds` and trained `tokens` (None: charged
        its seconds): its tokens at the running `seconds_per_token`."""
        share = self._share.get(tenant, 1.0)
        self._vtime[tenant] = self._vtime.get(tenant, 0.0) + self._charge(seconds, tokens) / share
        self._eligible_since[tenant] = self.clock()  # its wait restarts
        prev = self.step_seconds.get(tenant)
        self.step_seconds[tenant] = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        if self.metrics is not None:
            self.metrics.step_seconds.labels(self.label(tenant)).observe(seconds)

    def _charge(self, seconds: float, tokens: int | None) -> float:
        """Seconds to charge: `seconds`, or `tokens` at the running cost per token (which this
        step updates first, so that the first step recorded with tokens is charged its seconds)."""
        if tokens is None:
            return seconds
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            prev = self.seconds_per_token
            self.seconds_per_token = rate if prev is None else 0.95 * prev + 0.05 * rate
        return tokens * (self.seconds_per_token or 0.0)

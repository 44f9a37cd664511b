"""Freshness: how long a feedback event takes to reach what serving answers with.

The webhook stamps each feedback event with its own clock when it accepts it (`accepted_at`,
just before the broker write its 202 waits for); the training examples built from the event
carry that time. For each version it publishes, the learner records the version's lineage
(`VersionLineage`): the feedback events first trained in it, each with its accept time (a
replayed example was first trained in an earlier version and does not count again). When the
gateway first answers a completion with a version it claims the version's first-served time
(`Registry.claim_first_served`, atomic: one claimer among every gateway), and the claimer turns
the lineage into per-event freshness, `first_served_at - accepted_at`, observed in the
`clora_feedback_to_served_seconds` histogram and summed up on the version (`FreshnessSummary`).

Worked example: v3 trained first on events fb-1 (accepted at 100.0) and fb-2 (at 130.0) and
was published at 150.0; its first completion was served at 160.0. Freshness 60 s and 30 s:
`FreshnessSummary(events=2, unmeasured=0, p50_s=45.0, p99_s=59.7, first_served_at=160.0,
published_to_served_s=10.0)`. Of fb-1's 60 s, 50 were learning (waiting for the learner, the
step, the gate, the publish) and 10 serving (the swap, then the next request).

This module holds the records and the arithmetic; the registry stores them (one key per
version for a lineage, which can hold thousands of events).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field


class VersionLineage(BaseModel):
    """The feedback events first trained in one version. Example: `VersionLineage(accepted_at=
    {"fb-1": 100.0, "fb-2": 130.0, "fb-old": None}, over_cap=0)`: fb-old came from a webhook that
    did not stamp accept times yet, so it counts but cannot be measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    accepted_at: dict[str, float | None] = Field(default_factory=dict)
    """Feedback event id -> when the webhook accepted it (unix seconds; None: not recorded)."""
    over_cap: int = Field(default=0, ge=0)
    """Events first trained in this version beyond the learner's cap (`LearnerSettings.
    lineage_max_events`): counted, not listed. An event past the cap whose correction made two
    examples (an SFT example and a preference pair) may count twice here."""

    @property
    def events(self) -> int:
        """Every event first trained in the version, listed or not."""
        return len(self.accepted_at) + self.over_cap

    def extended(self, events: Iterable[tuple[str, float | None]], cap: int) -> VersionLineage:
        """This lineage with `events` ((event id, accepted_at) pairs) added: an event already
        listed is not added again (one correction can make two examples); past `cap` listed
        events the rest are only counted. Example: {fb-1} extended by fb-1, fb-2, fb-3 with cap 2
        -> {fb-1, fb-2}, over_cap 1."""
        accepted, over = dict(self.accepted_at), self.over_cap
        for event_id, at in events:
            if event_id in accepted:
                continue
            if len(accepted) < cap:
                accepted[event_id] = at
            else:
                over += 1
        return VersionLineage(accepted_at=accepted, over_cap=over)

    def freshness(self, served_at: float) -> list[float]:
        """Seconds from each listed event's acceptance to `served_at`, for events with an accept
        time. Clocks of different hosts may disagree by a little: a negative span reads 0."""
        return [max(0.0, served_at - at) for at in self.accepted_at.values() if at is not None]


class FreshnessSummary(BaseModel):
    """One version's feedback -> served latency, computed once by the gateway that first served
    it (the module docstring has a worked example)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    events: int = Field(ge=0)
    """Lineage events measured (listed, with an accept time)."""
    unmeasured: int = Field(default=0, ge=0)
    """Lineage events that could not be measured: without an accept time, or past the cap."""
    p50_s: float | None = None
    """Median seconds from an event's 202 to the version's first completion (None: no events)."""
    p99_s: float | None = None
    first_served_at: float
    """When the gateway first answered a completion with this version (unix seconds)."""
    published_to_served_s: float | None = None
    """`first_served_at` minus the version's `created_at`: the serving share of every event's
    freshness (the hot swap, then the next request for the version). None: the version's
    record was gone (pruned) when it was first served."""

    @classmethod
    def of(cls, lineage: VersionLineage, first_served_at: float, created_at: float | None) -> FreshnessSummary:
        seconds = lineage.freshness(first_served_at)
        return cls(events=len(seconds), unmeasured=lineage.events - len(seconds),
                   p50_s=percentile(seconds, 50) if seconds else None,
                   p99_s=percentile(seconds, 99) if seconds else None, first_served_at=first_served_at,
                   published_to_served_s=None if created_at is None else max(0.0, first_served_at - created_at))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, linearly interpolated between the two nearest
    ranks (numpy's default). [30, 60] -> p50 45.0, p99 59.7. ValueError when `values` is empty."""
    if not values:
        raise ValueError("the percentile of no values is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    at = (len(xs) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)

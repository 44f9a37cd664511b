"""The learner loop's record of one tenant: `LearnerTenant`.

What the loop keeps about a registered tenant between ticks, in one object: whether it needs
a checkpoint, its failure back-off, where its batch was last checked for a reward spread (and
held, when it was one group that may still grow), and the publish gate's cache of its live
version's held-out losses. The parts are defined where they are used (`backoff.Backoff`,
`sampling.BatchSeen`, `gate.LiveLosses`).

The tenant's training state itself (weights, moments, step, cursor, the version its weights
descend from) is its `AdapterState`, in the adapter store and its checkpoint. This record is
not saved: after a restart every tenant starts with an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parts' modules read this record; it only names their types
    from clora.learner.backoff import Backoff
    from clora.learner.gate import LiveLosses
    from clora.learner.sampling import BatchSeen


@dataclass
class LearnerTenant:
    """Example: a tenant that trained since its last checkpoint, then failed once:
    `LearnerTenant(dirty=True, backoff=Backoff(failures=1, wait_s=5.0, retry_at=1045.2))`."""

    dirty: bool = False
    """Trained, or its cursor moved, since its last checkpoint: `shutdown` checkpoints it."""
    backoff: Backoff | None = None
    """Set while its last step failed: it is not offered to the scheduler before `retry_at`."""
    flat_checked: BatchSeen | None = None
    """Where its batch was last checked for a reward spread (on-policy RL only)."""
    flat_held: BatchSeen | None = None
    """Where its batch was one group without a reward spread that may still grow
    (`Sampler.flat_cut`): it is not offered to the scheduler while its batch stays there."""
    live_losses: LiveLosses | None = None
    """The publish gate's cache: its live version's loss on each held-out example scored so far."""

    def waits(self, now: float) -> bool:
        """Whether a failed step's back-off still holds it back at monotonic time `now`."""
        return self.backoff is not None and self.backoff.retry_at > now

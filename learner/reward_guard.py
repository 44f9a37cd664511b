"""The reward guard: roll a tenant back when its live version earns measurably lower rewards
than the version it replaced.

The publish gate judges a candidate before it ships, on held-out loss. A lower loss is not
always a better policy: a version can match its parent's held-out loss and earn far lower
rewards. The guard judges what the gate cannot see, the rewards a version earned once it
served: every RL episode whose samples reach the buffer adds its reward once to
the tally of the version that served it (`ReplayBuffer.version_rewards`). A "scored sample"
below is such an episode: the agent runtime names each episode (`metadata.episode_id`), so a
three-turn episode is one observation, not three correlated ones that would shrink the
standard error and weigh long episodes more; a sample of a client that names no episodes
counts alone.

The decision, for live version L:

- the reference R is L's newest ancestor (parent, grandparent, ...) that has served at least
  `min_samples` scored samples (a version that lived too briefly to be judged is skipped);
- L is rolled back to R when L has served `min_samples` too and its mean reward is lower than
  R's by at least `margin` and by at least `z` standard errors (Welch:
  se = sqrt(var_R / n_R + var_L / n_L)).

Both conditions guard against false alarms: the margin keeps a long-lived version with
thousands of samples from being rolled back over a trivial difference, the z-test keeps a
few unlucky samples from rolling back a good one. The base model is never a reference: going
back to no adapter at all is an operator's call.

Example: R has 40 samples with mean 0.80, L has 12 with mean 0.25 (rewards 0/1):
se = sqrt(0.164/40 + 0.205/12) = 0.146, the drop 0.55 is 3.8 se and over the 0.1 margin: roll back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clora.ingest.buffers import RewardTally


@dataclass(frozen=True)
class GuardSettings:
    min_samples: int
    margin: float
    z: float


@dataclass(frozen=True)
class GuardVerdict:
    live: int
    reference: int | None
    """The ancestor the live version was compared with (None: none has enough samples)."""
    rollback: bool
    reason: str
    live_reward: RewardTally | None = None
    reference_reward: RewardTally | None = None

    def summary(self) -> dict[str, float | int | str | None]:
        """JSON-able numbers for the version's record, the history and the log."""
        out: dict[str, float | int | str | None] = {"reference": self.reference, "reason": self.reason}
        for name, t in (("live", self.live_reward), ("reference", self.reference_reward)):
            if t is not None:
                out[f"{name}_reward"], out[f"{name}_samples"] = t.mean, t.n
        return out


def measured(tally: RewardTally | None, min_samples: int) -> bool:
    """Whether a version has served enough scored samples to be judged or compared with."""
    return tally is not None and tally.n >= min_samples


def reference_version(live: int, parents: dict[int, int | None], tallies: dict[int | None, RewardTally],
                      min_samples: int) -> int | None:
    """The newest ancestor of `live` with at least `min_samples` scored samples, or None."""
    seen = {live}
    v = parents.get(live)
    while v is not None and v not in seen:   # lineage is acyclic by construction; don't trust it
        seen.add(v)
        if measured(tallies.get(v), min_samples):
            return v
        v = parents.get(v)
    return None


def judge(live: int, parents: dict[int, int | None], tallies: dict[int | None, RewardTally],
          settings: GuardSettings) -> GuardVerdict:
    """Whether to roll `live` back (see the module docstring). `parents` maps each recorded
    version to its parent version."""
    mine = tallies.get(live)
    if not measured(mine, settings.min_samples):
        return GuardVerdict(live, None, False, f"v{live} has {mine.n if mine else 0} scored samples, "
                                               f"needs {settings.min_samples}", mine)
    ref = reference_version(live, parents, tallies, settings.min_samples)
    if ref is None:
        return GuardVerdict(live, None, False, f"no ancestor of v{live} has {settings.min_samples} scored samples",
                            mine)
    theirs = tallies[ref]
    drop = theirs.mean - mine.mean
    se = math.sqrt(theirs.variance / theirs.n + mine.variance / mine.n)
    z = math.inf if se == 0 and drop > 0 else 0.0 if se == 0 else drop / se
    facts = (f"mean reward {mine.mean:.3f} over {mine.n} samples vs v{ref}'s {theirs.mean:.3f} over "
             f"{theirs.n}: drop {drop:.3f}, {z:.1f} standard errors")
    rollback = drop >= settings.margin and z >= settings.z
    return GuardVerdict(live, ref, rollback, facts, mine, theirs)

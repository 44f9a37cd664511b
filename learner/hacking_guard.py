"""The reward-hacking guard's decision: a live version whose rewards held up or rose while its
served replies degenerated has learned to please the reward, not to do the task.

The reward guard (`reward_guard`) catches a version that earns less. A reward that pays for
the wrong thing (shorter is better, any tool call is good) is the opposite case: the rewards
rise as the replies get worse. So the ingest worker keeps, per serving version, signals that
no reward sees (`clora.ingest.signals.ServedSignals`: empty replies, unparseable tool calls,
reply length, answer diversity), and this guard compares them.

The decision, for live version L, which needs `min_samples` scored samples and `min_replies`
served replies: L is compared with each of its ancestors measured as well, newest first (the
base model never: going back to no adapter is an operator's call). The first ancestor R
against which

- L's mean reward did not fall: it is at most `reward_margin` below R's (a larger drop is the
  reward guard's to judge);
- and at least one signal degraded (below)

is the reference: the guard trips, and L is rolled back to R. Not only the newest measured
ancestor, as the reward guard compares with: a reward that pays for degeneration makes a slide,
and once a degenerate version has been measured, its degenerate successors look fine beside
it. Comparing with every measured ancestor finds the last version before the slide.

The signals, each of L against R:

- `empty`: the share of empty replies rose by at least `empty_rise` and `z` standard errors;
- `bad_tool_calls`: the share of replies with an unparseable tool call rose by at least
  `bad_tool_call_rise` and `z` standard errors;
- `length`: the mean reply length fell below R's / `length_factor` or rose above R's x
  `length_factor`, by at least `z` standard errors;
- `diversity`: distinct replies per distinct prompt (`ServedSignals.diversity`) fell below
  `diversity_fraction` x R's. Per prompt, not per reply: an RL group's episodes share a prompt,
  and a policy that learned the task answers them alike.

The rates' z is the two-proportion test's (pooled p: se = sqrt(p (1 - p) (1/n_R + 1/n_L))); the
length's is Welch's, as the reward guard's.

Example: R served 40 replies (2 empty, mean 60 characters, diversity 0.95) and earned 0.40 over
20 scored samples; L served 30 replies (21 empty, mean 3 characters, diversity 0.13) and earns
0.90 over 15. The reward rose; empty replies rose from 0.05 to 0.70 (+0.65, 5.7 standard errors),
the mean length fell 20-fold, diversity fell to 0.14 of R's: the guard trips on all three, and
the learner pauses the tenant and rolls it back to R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clora.ingest.buffers import RewardTally
from clora.ingest.signals import ServedSignals
from clora.learner.reward_guard import measured, reference_version


@dataclass(frozen=True)
class HackingSettings:
    """A tenant's thresholds (its `LearningPolicy`'s `hacking_guard_*`, the reward guard's
    `reward_guard_min_samples` and `reward_guard_margin`, the learner's `reward_guard_z`)."""

    min_samples: int
    min_replies: int
    reward_margin: float
    empty_rise: float
    bad_tool_call_rise: float
    length_factor: float
    diversity_fraction: float
    z: float


@dataclass(frozen=True)
class HackingVerdict:
    live: int
    reference: int | None
    """The ancestor the live version was compared with (None: none is measured well enough)."""
    trip: bool
    reason: str
    degraded: tuple[str, ...] = ()
    """The signals that degraded: `empty`, `bad_tool_calls`, `length`, `diversity`."""
    live_reward: RewardTally | None = None
    reference_reward: RewardTally | None = None
    live_signals: ServedSignals | None = None
    reference_signals: ServedSignals | None = None

    def summary(self) -> dict:
        """JSON-able numbers for the version's record, the alert and the log."""
        out: dict = {"reference": self.reference, "reason": self.reason, "degraded": list(self.degraded)}
        for name, t in (("live", self.live_reward), ("reference", self.reference_reward)):
            if t is not None:
                out[f"{name}_reward"], out[f"{name}_samples"] = t.mean, t.n
        for name, s in (("live", self.live_signals), ("reference", self.reference_signals)):
            if s is not None:
                out[f"{name}_signals"] = s.summary()
        return out


def judge(live: int, parents: dict[int, int | None], tallies: dict[int | None, RewardTally],
          signals: dict[int | None, ServedSignals], settings: HackingSettings) -> HackingVerdict:
    """Whether `live` hacked its reward (see the module docstring). `parents` maps each recorded
    version to its parent version."""
    s = settings
    mine, served = tallies.get(live), signals.get(live)
    if not measured(mine, s.min_samples) or not _served(served, s.min_replies):
        return HackingVerdict(live, None, False, f"v{live} has {mine.n if mine else 0} scored samples and "
                                                 f"{served.n if served else 0} replies, needs {s.min_samples} and "
                                                 f"{s.min_replies}", live_reward=mine, live_signals=served)
    both = {v: t for v, t in tallies.items() if _served(signals.get(v), s.min_replies)}
    first: HackingVerdict | None = None
    compared = {live}
    ref = reference_version(live, parents, both, s.min_samples)
    while ref is not None and ref not in compared:        # lineage is acyclic by construction; don't trust it
        compared.add(ref)
        verdict = _compare(live, ref, tallies, signals, s)
        if verdict.trip:
            return verdict
        first = first or verdict
        ref = reference_version(ref, parents, both, s.min_samples)
    if first is None:
        return HackingVerdict(live, None, False, f"no ancestor of v{live} has {s.min_samples} scored samples and "
                                                 f"{s.min_replies} replies", live_reward=mine, live_signals=served)
    return first           # the newest measured ancestor's comparison says why not


def _compare(live: int, ref: int, tallies: dict[int | None, RewardTally], signals: dict[int | None, ServedSignals],
             s: HackingSettings) -> HackingVerdict:
    """L against one measured ancestor R: trips when the reward did not fall and a signal degraded."""
    mine, served, theirs, before = tallies[live], signals[live], tallies[ref], signals[ref]
    found = dict(live=live, reference=ref, live_reward=mine, reference_reward=theirs, live_signals=served,
                 reference_signals=before)
    drop = theirs.mean - mine.mean
    rewards = f"mean reward {mine.mean:.3f} vs v{ref}'s {theirs.mean:.3f}"
    if drop > s.reward_margin:
        return HackingVerdict(trip=False, reason=f"{rewards}: the reward fell (the reward guard's to judge)", **found)
    degraded = {}
    rise = served.empty_rate - before.empty_rate
    if rise >= s.empty_rise and _proportion_z(served.empty, served.n, before.empty, before.n) >= s.z:
        degraded["empty"] = f"empty replies {before.empty_rate:.2f} -> {served.empty_rate:.2f}"
    rise = served.bad_tool_call_rate - before.bad_tool_call_rate
    if rise >= s.bad_tool_call_rise and _proportion_z(served.bad_tool_calls, served.n, before.bad_tool_calls,
                                                      before.n) >= s.z:
        degraded["bad_tool_calls"] = (f"unparseable tool calls {before.bad_tool_call_rate:.2f} -> "
                                      f"{served.bad_tool_call_rate:.2f}")
    if before.mean_length > 0 and _length_changed(served, before, s.length_factor, s.z):
        degraded["length"] = f"mean length {before.mean_length:.1f} -> {served.mean_length:.1f} characters"
    if served.diversity < s.diversity_fraction * before.diversity:
        degraded["diversity"] = f"answer diversity {before.diversity:.2f} -> {served.diversity:.2f}"
    if not degraded:
        return HackingVerdict(trip=False, reason=f"{rewards}; served replies did not degenerate", **found)
    return HackingVerdict(trip=True, degraded=tuple(degraded), **found,
                          reason=f"{rewards} while its replies degenerated: {'; '.join(degraded.values())} "
                                 f"({served.n} replies vs {before.n})")


def _served(signals: ServedSignals | None, min_replies: int) -> bool:
    return signals is not None and signals.n >= min_replies


def _proportion_z(k_live: int, n_live: int, k_ref: int, n_ref: int) -> float:
    """Standard errors by which the live share k_live / n_live exceeds the reference's (pooled)."""
    p = (k_live + k_ref) / (n_live + n_ref)
    se = math.sqrt(p * (1 - p) * (1 / n_live + 1 / n_ref))
    diff = k_live / n_live - k_ref / n_ref
    return math.inf if se == 0 and diff > 0 else 0.0 if se == 0 else diff / se


def _length_changed(live: ServedSignals, ref: ServedSignals, factor: float, z: float) -> bool:
    """The mean length left [ref / factor, ref x factor], by at least `z` standard errors (Welch)."""
    if ref.mean_length / factor <= live.mean_length <= ref.mean_length * factor:
        return False
    se = math.sqrt(ref.length_variance / ref.n + live.length_variance / live.n)
    diff = abs(live.mean_length - ref.mean_length)
    return se == 0 or diff / se >= z

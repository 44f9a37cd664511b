"""The evaluation gate: which examples are held out, and whether a candidate may be published.

Held-out examples are chosen by a stable hash of their `example_id` (`is_held_out`), so the
same example is held out on every learner and after every restart, and is never trained on.
`gate` compares the candidate's held-out loss with the live version's on the same examples:
publish unless the candidate is worse than live by more than `tolerance` (relative).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def is_held_out(example_id: str, fraction: float) -> bool:
    """Deterministic split: True for about `fraction` of ids."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(example_id.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


@dataclass(frozen=True)
class GateDecision:
    """Example: candidate 0.52, live 0.50, tolerance 0.05 -> publish (0.52 <= 0.50 * 1.05)."""

    publish: bool
    candidate_loss: float
    live_loss: float | None
    tolerance: float
    reason: str


def gate(candidate_loss: float, live_loss: float | None, tolerance: float) -> GateDecision:
    if candidate_loss != candidate_loss:  # NaN
        return GateDecision(False, candidate_loss, live_loss, tolerance, "candidate eval loss is NaN")
    if live_loss is None:
        return GateDecision(True, candidate_loss, None, tolerance, "no live version yet")
    limit = live_loss + tolerance * abs(live_loss)
    if candidate_loss <= limit:
        return GateDecision(True, candidate_loss, live_loss, tolerance,
                            f"candidate {candidate_loss:.4f} <= live {live_loss:.4f} + {tolerance:.0%}")
    return GateDecision(False, candidate_loss, live_loss, tolerance,
                        f"candidate {candidate_loss:.4f} worse than live {live_loss:.4f} beyond {tolerance:.0%}")

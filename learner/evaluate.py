"""The evaluation gate: whether a candidate adapter version may be published.

Held-out examples come from the replay buffer (`ReplayBuffer.heldout`: a stable hash of the
example id keeps them out of training). `gate` compares the candidate's held-out loss with the live version's on the same examples:
publish unless the candidate is worse than live by more than `tolerance` (relative) and by
more than `min_margin` (absolute). The absolute floor matters once both losses are near 0: a
candidate at 0.0098 nats per token is not a regression from a live 0.0032, however many
percent apart they are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GateDecision:
    """Example: candidate 0.52, live 0.50, tolerance 0.05 -> publish (0.52 <= 0.50 * 1.05)."""

    publish: bool
    candidate_loss: float
    live_loss: float | None
    tolerance: float
    reason: str


def gate(candidate_loss: float, live_loss: float | None, tolerance: float, min_margin: float = 0.0) -> GateDecision:
    if candidate_loss != candidate_loss:  # NaN
        return GateDecision(False, candidate_loss, live_loss, tolerance, "candidate eval loss is NaN")
    if live_loss is None:
        return GateDecision(True, candidate_loss, None, tolerance, "no live version yet")
    margin = max(tolerance * abs(live_loss), min_margin)
    allowed = f"{tolerance:.0%}" if margin > min_margin else f"{min_margin:g}"
    if candidate_loss <= live_loss + margin:
        return GateDecision(True, candidate_loss, live_loss, tolerance,
                            f"candidate {candidate_loss:.4f} <= live {live_loss:.4f} + {allowed}")
    return GateDecision(False, candidate_loss, live_loss, tolerance,
                        f"candidate {candidate_loss:.4f} worse than live {live_loss:.4f} beyond {allowed}")

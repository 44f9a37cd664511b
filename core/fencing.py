"""Fencing tokens: the proof a writer shows that it still holds a lease, and the error a write
raises when it does not.

A learner trains a tenant only while it holds the tenant's lease (`clora.learner.leases`). Each
lease is taken with a fencing token from a counter that only grows, so a later holder always
has a larger token than every earlier one. A lease can lapse without its holder knowing (a long
pause, a partition), so every write of the tenant's training state that others can see carries
a `Fence`, and the store it writes to refuses it unless it is still current:

- the registry (`clora.registry`) checks, in the same Lua script as the write, that the lease key
  still holds exactly this holder and token;
- a checkpoint store (`clora.checkpoint_storage`) refuses a token older than one it already holds.
"""

from __future__ import annotations

from dataclasses import dataclass


class FencedOut(RuntimeError):
    """A write was refused because its writer no longer holds the current lease: another holder
    took over (or the lease lapsed). The writer must stop working on what the lease covered."""


@dataclass(frozen=True)
class Fence:
    """A held lease, as a write presents it. Example: learner `gpu-1-4242` holding tenant acme's
    lease with token 17: `Fence(key="clora:learner:lease:{acme}", holder="gpu-1-4242", token=17)`,
    whose `value` "17 gpu-1-4242" is what the lease key holds while the lease is current."""

    key: str
    """The Redis key of the lease (its owner, `clora.learner.leases`, names it)."""
    holder: str
    token: int
    """The fencing token: larger for every later holder of the same lease."""

    @property
    def value(self) -> str:
        return f"{self.token} {self.holder}"

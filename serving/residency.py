"""Registered vs resident adapters of one engine replica, and the ones it refused.

An adapter is *registered* with the gateway when some tenant version may be served (its
folder is known); it is *resident* in a replica when that replica's vLLM server has it
loaded. A replica holds at most `capacity` resident adapters (vLLM `--max-cpu-loras`).
`ResidentSet` is the bookkeeping only (no I/O): which names are resident, how many
in-flight requests pin each one, and which idle one was least recently used, so the engine
can evict it when a new one must be loaded. A pinned adapter is never evicted.

`Refusals` is the same kind of bookkeeping for the adapters a replica is out of rotation for:
its load failed or its canary did not match (`clora.canary`). Each is retried after a wait that
doubles with every failure; until then requests for that adapter go to other replicas, while
every other adapter still routes to this one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass


class CapacityError(RuntimeError):
    """Every resident adapter is pinned by in-flight requests: nothing can be evicted."""


@dataclass
class Resident:
    name: str
    path: str
    pins: int = 0
    """In-flight requests using this adapter on this replica."""
    last_used: int = 0
    """Logical clock of the last pin (higher is more recent)."""


class ResidentSet:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: dict[str, Resident] = {}
        self._clock = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Resident names, least recently used first."""
        return [r.name for r in sorted(self._items.values(), key=lambda r: r.last_used)]

    def pins(self, name: str) -> int:
        r = self._items.get(name)
        return r.pins if r else 0

    def add(self, name: str, path: str) -> None:
        if name not in self._items and len(self._items) >= self.capacity:
            raise CapacityError(f"cannot add {name}: {len(self._items)} of {self.capacity} slots resident")
        self._items.setdefault(name, Resident(name, path)).last_used = next(self._clock)

    def remove(self, name: str) -> Resident | None:
        """Take `name` out (None if it was not resident); `restore` puts it back."""
        return self._items.pop(name, None)

    def restore(self, r: Resident) -> None:
        self._items[r.name] = r

    def clear(self) -> None:
        self._items.clear()

    def touch(self, name: str) -> None:
        self._items[name].last_used = next(self._clock)

    def pin(self, name: str) -> None:
        r = self._items[name]
        r.pins += 1
        r.last_used = next(self._clock)

    def unpin(self, name: str) -> None:
        r = self._items.get(name)
        if r is not None and r.pins > 0:
            r.pins -= 1

    def full(self) -> bool:
        return len(self._items) >= self.capacity

    def victim(self) -> str:
        """The least recently used adapter no request is using. Raises CapacityError if all are busy."""
        idle = [r for r in self._items.values() if r.pins == 0]
        if not idle:
            raise CapacityError(f"all {len(self._items)} resident adapters (capacity {self.capacity}) "
                                f"are in use by in-flight requests")
        return min(idle, key=lambda r: r.last_used).name


@dataclass
class Refusal:
    """Why a replica is out of rotation for one adapter. Example: `Refusal("acme@v3", "canary_mismatch",
    "the adapter answers 0.42 nats/token from ...", failures=2, retry_at=1234.5)`: refused twice,
    tried again once the clock passes 1234.5."""

    name: str
    reason: str
    """A short label (the failures metric's `reason`): `load`, `canary_mismatch`, `not_applied`, ..."""
    detail: str
    failures: int
    retry_at: float
    """`clock()` time from which the adapter may be tried on this replica again."""


class Refusals:
    """The adapters one replica is out of rotation for, each with a doubling retry wait."""

    def __init__(self, retry_s: float, retry_max_s: float, clock: Callable[[], float] = time.monotonic):
        self.retry_s, self.retry_max_s, self.clock = retry_s, retry_max_s, clock
        self._items: dict[str, Refusal] = {}

    def add(self, name: str, reason: str, detail: str) -> Refusal:
        """Record a failure of `name`; returns it with its next retry time."""
        failures = self._items[name].failures + 1 if name in self._items else 1
        wait = min(self.retry_max_s, self.retry_s * 2 ** (failures - 1))
        r = self._items[name] = Refusal(name, reason, detail, failures, self.clock() + wait)
        return r

    def blocks(self, name: str) -> bool:
        """Whether `name` must not be routed to (or loaded into) this replica now."""
        r = self._items.get(name)
        return r is not None and self.clock() < r.retry_at

    def blocked(self) -> list[str]:
        """The adapters out of rotation now (refused, not yet due for a retry)."""
        now = self.clock()
        return [r.name for r in list(self._items.values()) if now < r.retry_at]

    def get(self, name: str) -> Refusal | None:
        return self._items.get(name)

    def clear(self, name: str | None = None) -> None:
        """Forget `name`'s failures (it passed), or every adapter's (None: the replica rejoined)."""
        if name is None:
            self._items.clear()
        else:
            self._items.pop(name, None)

    def items(self) -> list[Refusal]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

"""Registered vs resident adapters of one engine replica, and the ones it refused.

An adapter is *registered* with the gateway when some tenant version may be served (its
folder is known); it is *resident* in a replica when that replica's vLLM server has it
loaded: vLLM serves its name, and reads its folder again whenever it needs the weights. Of the
resident adapters vLLM keeps the `cached` most recently used in memory (`--max-cpu-loras`, its
own LRU cache); a request for another one makes vLLM re-read that folder, with no call from the
gateway. A replica holds at most `capacity` resident adapters (`EngineSettings.registered_loras`:
256 by default, at least `max_cpu_loras`).

`ResidentSet` is the bookkeeping only (no I/O): which names are resident, how many in-flight
requests pin each one, which idle one was least recently used (so the engine can evict it when
a new one must be loaded; a pinned adapter is never evicted), which ones are likely in vLLM's
memory (`warm`), and which versions passed their canary on this replica since it last started
(`verified`): re-loading one of those after an eviction needs no second canary. `clear` (the
replica restarted, or rejoined) forgets both.

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
    """One replica's resident adapters. Example: `ResidentSet(32, cached=8)` with 32 tenants'
    versions loaded: all 32 are served there without a load call, the 8 used last are `warm`,
    and a 33rd evicts the least recently used idle one."""

    def __init__(self, capacity: int, cached: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        cached = capacity if cached is None else cached
        if not 1 <= cached <= capacity:
            raise ValueError(f"cached must be in [1, capacity {capacity}], got {cached}")
        self.capacity = capacity
        """Resident (loaded) adapters at most."""
        self.cached = cached
        """Of those, how many vLLM keeps in memory (`--max-cpu-loras`)."""
        self._items: dict[str, Resident] = {}
        self._clock = itertools.count(1)
        self._verified: dict[str, str] = {}
        """Name -> the folder it was loaded from when it passed its canary here, since `clear`."""

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

    def warm(self, name: str) -> bool:
        """Whether `name` is resident and among the `cached` most recently used: as far as the
        gateway can tell, vLLM serves it from memory without re-reading its folder."""
        r = self._items.get(name)
        return r is not None and sum(o.last_used > r.last_used for o in self._items.values()) < self.cached

    def add(self, name: str, path: str) -> None:
        if name not in self._items and len(self._items) >= self.capacity:
            raise CapacityError(f"cannot add {name}: {len(self._items)} of {self.capacity} slots resident "
                                f"({self.cached} of them cached in memory)")
        self._items.setdefault(name, Resident(name, path)).last_used = next(self._clock)

    def remove(self, name: str) -> Resident | None:
        """Take `name` out (None if it was not resident); `restore` puts it back."""
        return self._items.pop(name, None)

    def restore(self, r: Resident) -> None:
        self._items[r.name] = r

    def clear(self) -> None:
        """Forget everything: the replica (re)started, or rejoined; it holds nothing it was not
        given again, and nothing loaded from now on was verified there."""
        self._items.clear()
        self._verified.clear()

    def verified(self, name: str, path: str) -> bool:
        """Whether `name`, loaded from `path`, passed its canary on this replica since `clear`."""
        return self._verified.get(name) == path

    def mark_verified(self, name: str, path: str) -> None:
        self._verified[name] = path

    def forget_verified(self, name: str | None = None) -> None:
        """Verify `name` (None: every adapter) again on its next load."""
        if name is None:
            self._verified.clear()
        else:
            self._verified.pop(name, None)

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
            raise CapacityError(f"all {len(self._items)} resident adapters (capacity {self.capacity}, {self.cached} "
                                f"cached in memory) are in use by in-flight requests")
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

"""Which learner trains which tenant: leases in Redis with fencing tokens (`RedisLeases`), or, for
a learner on its own without Redis, every tenant (`SoleLearner`).

Why leases and not Kafka's consumer groups. A learner reads the replay buffers in Redis, not a
Kafka topic: nothing it consumes has partitions to assign, and ingest's partitions are keyed by
tenant for ordering, not sized for sharing training (a tenant's partition would pin it to a
learner however the load falls). A consumer group also gives no fencing token: a learner
paused past its session timeout learns it was kicked out only at its next poll, and its writes
meanwhile (checkpoint, version, live flip) would go through. Leases live where the learner's
state is recorded (Redis), are counted per tenant, and come with a token every write can be
checked against (`clora.fencing`).

How it works (`RedisLeases`, keys under `clora:learner:`):

    clora:learner:lease:{<tenant>}        "<token> <learner id>", with a TTL (`lease_ttl_s`)
    clora:learner:lease:{<tenant>}:token  the tenant's fencing-token counter (INCR; never reset)
    clora:learner:members:<pool>          sorted set: learner id -> when its heartbeat expires (ms)

- **Acquire**: one script: when the lease key is free, INCR the tenant's counter and SET the
  lease (NX-style, with PX = the TTL) to that token and the learner's id. A lease held under
  this learner's own id by an earlier process (a learner restarted under the same id: `clora
  up` gives its learner a stable one) is taken back at once, with a new token; so learner ids
  must be unique among running learners (the default, `<hostname>-<pid>`, is).
- **Renew**: every tick (`sync`), before each step, checkpoint and publish (`check`), and every
  `lease_ttl_s` / 3 from a keep-alive thread (`keep_alive`), every lease the learner holds has
  its TTL restarted, each only where it still holds exactly this token and holder. The thread
  keeps a step longer than the TTL (a large base on CPU, a long first step) from losing its
  lease mid-step, which would discard the step and retry it forever; it renews only while the
  loop has ticked within `lease_keepalive_s`. A learner killed with -9 renews nothing, and its
  leases lapse after `lease_ttl_s`; one whose loop hangs, `lease_keepalive_s` later.
- **Fair share**: each learner renews its heartbeat in its pool's `members` (one pool,
  `default`, in a deployment; tests use their own) at every tick, with the same TTL; the live
  learners are the unexpired members. With T tenants and L live learners a learner holds at most
  ceil(T / L); it takes free leases up to that, in its own rendezvous-hash order of the tenants
  (so learners reach for different tenants first), but only up to floor(T / L) while another
  live learner holds fewer than floor(T / L); and when one does and no lease is free, learners
  above the floor hand the excess back (checkpoint, then release), so a learner that joins gets
  its share within a few ticks: 7 tenants over 3 learners settle as 3, 2, 2.
- **Lose**: a lease found taken (or lapsed) at renewal is lost: the learner drops the tenant's
  state at once, without writing anything.
- **Release**: on shutdown (after the last checkpoints; its heartbeat member goes too), and for
  a hand-off: deleted only where the key still holds this lease.

Failover bound: a learner killed with -9 stops renewing; its leases and its heartbeat lapse at
most `lease_ttl_s` after its last renewal (at most `lease_ttl_s` / 3 before the kill), and every other learner's next `sync` (one tick: at most
`idle_sleep_s` when idle, one step with its gate and publish when busy) counts one learner fewer
and takes the free leases. So a dead learner's tenants have a new holder within `lease_ttl_s` +
one tick of the survivors, and train again at its next step after the newest checkpoint is read.

Redis Cluster: the lease and its counter share a hash tag; the fenced registry writes touch the
registry's keys and the lease's, which is one reason clora needs one Redis primary (docs/deploy.md).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clora.fencing import Fence, FencedOut

log = logging.getLogger(__name__)

PREFIX = "clora:learner:"

_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, string.find(held, ' ') + 1) ~= ARGV[1] then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1], 'PX', ARGV[2])
return token
"""
_RENEW = """
local held = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
"""
_RELEASE = """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then redis.call('DEL', key) end
end
return 1
"""
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


def default_learner_id() -> str:
    """`<hostname>-<pid>`: unique per process, and readable in logs and in Redis."""
    return f"{socket.gethostname()}-{os.getpid()}"


def lease_key(tenant: str) -> str:
    return PREFIX + "lease:{" + tenant + "}"


def fair_share(tenants: int, learners: int) -> int:
    """The most tenants one learner takes: ceil(tenants / live learners). Example: 5 tenants, 2
    learners -> 3 (and the other takes 2)."""
    return math.ceil(tenants / max(1, learners))


def rendezvous(learner: str, tenant: str) -> bytes:
    """`learner`'s preference for `tenant` (larger first): highest-random-weight hashing, so two
    learners looking for free leases reach for different tenants first."""
    return hashlib.blake2b(f"{learner}\0{tenant}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class LeaseChanges:
    """What one `sync` changed. Example: a learner that found a dead learner's lease on `beta`
    free and its own on `acme` taken by another: `LeaseChanges(gained=("beta",), lost=("acme",))`;
    after a third learner joined, `surplus` names the tenants beyond its fair share, which it
    checkpoints and then `release`s."""

    gained: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    surplus: tuple[str, ...] = ()


class Leases(Protocol):
    learner_id: str

    def sync(self, tenants: Sequence[str]) -> LeaseChanges:
        """One tick's lease work over the registry's `tenants`: heartbeat, renew, take, hand back."""

    def holds(self, tenant: str) -> bool:
        """Whether this learner believes it holds `tenant` (as of its last renewal)."""

    def check(self, tenant: str) -> Fence | None:
        """Renew every held lease and return `tenant`'s fence (None without fencing); `FencedOut`
        when `tenant`'s lease is no longer this learner's."""

    def release(self, tenants: Iterable[str]) -> None:
        """Give up `tenants`' leases (only where still held)."""

    def close(self) -> None:
        """Release every lease and leave the members (clean shutdown)."""


@dataclass
class SoleLearner:
    """The only learner: every tenant is its own, without Redis or fencing (tests, and a
    learner built without leases)."""

    learner_id: str = "sole"
    held: set[str] = field(default_factory=set)

    def sync(self, tenants: Sequence[str]) -> LeaseChanges:
        gained = tuple(t for t in tenants if t not in self.held)
        self.held.update(gained)
        return LeaseChanges(gained=gained)

    def holds(self, tenant: str) -> bool:
        return tenant in self.held

    def check(self, tenant: str) -> Fence | None:
        return None

    def release(self, tenants: Iterable[str]) -> None:
        self.held.difference_update(tenants)

    def close(self) -> None:
        self.held.clear()


class RedisLeases:
    """Tenant leases in Redis with fencing tokens (see the module docstring). One learner loop
    uses it, and its `keep_alive` thread renews beside it (every method takes one lock)."""

    def __init__(self, client, learner_id: str, ttl_s: float, pool: str = "default"):
        self.r = client
        self.learner_id = learner_id
        self.members = f"{PREFIX}members:{pool}"
        """The heartbeats of the learners sharing the tenants (`fair_share` counts them)."""
        self.ttl_ms = int(ttl_s * 1000)
        self.fences: dict[str, Fence] = {}
        """The leases this learner holds, by tenant (as of the last renewal)."""
        self.live = 1
        """Live learners at the last heartbeat, this one included."""
        self._lost: dict[str, None] = {}
        """Leases found lost since the last `sync` reported them (in order)."""
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._beat = client.register_script(_BEAT)
        self._lock = threading.RLock()
        """Held by every method: the loop and the keep-alive thread share `fences`."""

    def holds(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self.fences

    def beat(self) -> list[str]:
        """Renew this learner's heartbeat; returns the live learners' ids (this one's included)."""
        with self._lock:
            live = [m.decode() for m in self._beat(keys=[self.members], args=[self.learner_id, self.ttl_ms])]
            self.live = len(live)
            return live

    def renew(self) -> tuple[str, ...]:
        """Restart the TTL of every held lease; returns (and forgets) those no longer held."""
        with self._lock:
            if not self.fences:
                return ()
            tenants = sorted(self.fences)
            held = self._renew(keys=[self.fences[t].key for t in tenants],
                               args=[self.ttl_ms, *(self.fences[t].value for t in tenants)])
            lost = tuple(t for t, ok in zip(tenants, held) if not int(ok))
            for t in lost:
                del self.fences[t]
                self._lost[t] = None
            return lost

    def keep_alive(self, ticked_within: Callable[[float], bool], max_silence_s: float,
                   stop: threading.Event) -> threading.Thread:
        """Renew this learner's heartbeat and leases every TTL / 3 from a daemon thread until
        `stop` is set, while `ticked_within(max_silence_s)` says the loop is still making
        progress: a step longer than the TTL keeps its lease, a hung loop does not keep its
        tenants. A renewal that fails (Redis away) is logged and tried again next period."""
        period = self.ttl_ms / 3000

        def run() -> None:
            while not stop.wait(period):
                if not ticked_within(max_silence_s):
                    continue
                try:
                    self.beat()
                    self.renew()
                except Exception as e:  # noqa: BLE001 - the loop's own renewal says what is lost
                    log.warning("learner %s could not renew its leases: %s", self.learner_id, e)

        thread = threading.Thread(target=run, name="lease-keepalive", daemon=True)
        thread.start()
        return thread

    def acquire(self, tenant: str) -> Fence | None:
        """Take `tenant`'s lease when it is free (or held under this learner's id by an earlier
        process); its fence, or None when another learner holds it."""
        key = lease_key(tenant)
        with self._lock:
            token = int(self._acquire(keys=[key, key + ":token"], args=[self.learner_id, self.ttl_ms]))
            if not token:
                return None
            self.fences[tenant] = fence = Fence(key, self.learner_id, token)
            return fence

    def sync(self, tenants: Sequence[str]) -> LeaseChanges:
        with self._lock:
            return self._sync(tenants)

    def _sync(self, tenants: Sequence[str]) -> LeaseChanges:
        live = self.beat()
        self.renew()
        lost, self._lost = list(self._lost), {}
        known = list(dict.fromkeys(tenants))
        self.release([t for t in self.fences if t not in set(known)])   # deleted from the registry
        holders = dict(zip(known, self.r.mget([lease_key(t) for t in known]) if known else []))
        counts = Counter(raw.decode().split(" ", 1)[1] for raw in holders.values() if raw is not None)
        lo, hi = len(known) // len(live), fair_share(len(known), len(live))
        free = [t for t, raw in holders.items()
                if raw is None or (t not in self.fences and raw.decode().split(" ", 1)[1] == self.learner_id)]
        starving = any(counts[m] < lo for m in live if m != self.learner_id)
        # hold at most the fair share; while another live learner has fewer than the floor and
        # nothing is free, come down to the floor; take free leases up to the floor while another
        # is below it, else up to the fair share
        keep = lo if starving and not free else hi
        mine = sorted(self.fences, key=lambda t: rendezvous(self.learner_id, t))
        surplus = tuple(mine[:max(0, len(mine) - keep)])      # the ones it cares least for go first
        gained = []
        room = (lo if starving else hi) - len(self.fences)
        for tenant in sorted(free, key=lambda t: rendezvous(self.learner_id, t), reverse=True):
            if len(gained) >= room:
                break
            if self.acquire(tenant) is not None:
                gained.append(tenant)
        if gained or lost or surplus:
            log.info("learner %s (%d live, share %d-%d): took %s, lost %s, handing back %s", self.learner_id,
                     len(live), lo, hi, gained, lost, list(surplus))
        return LeaseChanges(tuple(gained), tuple(lost), surplus)

    def check(self, tenant: str) -> Fence:
        with self._lock:
            lost = self.renew()
            fence = self.fences.get(tenant)
            if fence is None:
                lapsed = tenant in lost or tenant in self._lost    # found lost here or by the keep-alive
                raise FencedOut(f"learner {self.learner_id} no longer holds {tenant}'s lease"
                                + (" (taken over or lapsed)" if lapsed else ""))
            return fence

    def release(self, tenants: Iterable[str]) -> None:
        with self._lock:
            fences = [self.fences.pop(t) for t in tenants if t in self.fences]
            if fences:
                self._release(keys=[f.key for f in fences], args=[f.value for f in fences])

    def close(self) -> None:
        with self._lock:
            self.release(list(self.fences))
            self.r.zrem(self.members, self.learner_id)

    def holder(self, tenant: str) -> Fence | None:
        """Who holds `tenant`'s lease now (any learner), as its fence; None when it is free."""
        raw = self.r.get(lease_key(tenant))
        if raw is None:
            return None
        token, holder = raw.decode().split(" ", 1)
        return Fence(lease_key(tenant), holder, int(token))

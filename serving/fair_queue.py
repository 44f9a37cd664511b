"""Fair admission: which tenant's request the gateway sends to the engine next when it is full.

vLLM serves the requests it holds first come, first served, so a tenant offering 10x the load
gets ~10x the tokens unless its quota refuses it. The gateway therefore keeps at most
`capacity` engine sequences in flight (`GatewaySettings.fair_sequences`; by default the
engine's sequence slots, replicas x `max_num_seqs`: all vLLM runs at once anyway, so the bound
costs no batch width) and queues the rest per tenant. When sequences free up, the next request
is the head of the waiting tenant with the smallest virtual time: stride scheduling over
generated tokens, as the learner's scheduler (`clora.learner.scheduler`) does over training:

    pass[t] += cost / weight[t]         cost = max_tokens x n (the most the request generates)

and when the request ends the charge is corrected to what it generated (`Ticket.generated`). A
tenant that starts waiting starts at the current virtual time (the pass at which the last
request was sent), so idle time earns no burst. `weight` is the tenant's fair-share weight,
`LearningPolicy.weight`, the one the learner's scheduler uses (`TenantWeights` reads it).

Worked example, capacity 2, weights 1, every request max_tokens 10: A sends 4 requests, then B
sends 1. A's first two go at once (A's pass 0 -> 10 -> 20); A's 3rd and 4th and B's wait, B
starting at virtual time 10. When a sequence frees, B (pass 10) goes before A (pass 20).

**Shares while others want theirs.** Fair order alone is not enough when requests differ in
length: a tenant with nothing waiting at the moment a slot frees (its clients are between two
requests, a round trip away) loses that slot to the others, and a long request holds it for its
whole generation. Closed-loop clients of short requests are between requests at exactly those
moments, so under a 10:1 skew the heavy tenant ends up with most slots. So while several tenants
are active, none holds more than its weighted share of the sequences, rounded up:

    in_flight[t] + n <= ceil(capacity x weight[t] / sum of the active tenants' weights)

(a tenant with nothing in flight may always send one request; `shares=False` turns this off,
the gateway's default: `GatewaySettings.fair_shares`). A tenant is active while it has
requests waiting, and for `grace_s` after one of its requests ended: the time its clients take to
send the next. Requests in flight alone do not make it active (it wants nothing more now). A slot
left free for an active tenant's sake is held that long at most: a timer sends the next request
when the grace runs out.

No tenant waits unboundedly: each send raises the sender's pass by at least 1 / weight while a
waiting tenant's pass stays put, so it is the smallest after a bounded number of sends; and
the order is strict (when the chosen head needs more sequences than are free, nothing overtakes
it), so a request of n = 8 is not starved by requests of n = 1. A request cancelled while it
waits (its client gone, `fair_wait_s` passed) leaves the queue and frees its place.

Why here rather than vLLM's `priority` scheduling (`--scheduling-policy priority` with
per-request priorities from the tenant's virtual time): a priority is fixed when the request
reaches vLLM, so neither the correction to the tokens actually generated nor a weight change
reaches requests already there; vLLM's priority scheduler preempts running sequences for
higher-priority arrivals (their KV cache recomputed), engine time lost under exactly the skew
this is for; and it is an engine flag every replica, remote ones included, would need. The
cost of the gateway queue: a freed slot is refilled after a gateway round trip instead of from
vLLM's own queue (`clora bench fairness` reports the throughput ratio).

The queue is per gateway process: with several gateway instances in front of one engine, set
`fair_sequences` to its share of the engine's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """One request's place among the engine sequences in flight; `FairQueue.release` gives it
    back. Example: Ticket("acme", sequences=2, cost=128.0, weight=1.0, waited_s=0.3)."""

    tenant: str
    sequences: int
    cost: float
    """Tokens charged when it was sent (`max_tokens` x n)."""
    weight: float
    """The tenant's weight when it was charged."""
    waited_s: float
    """How long it waited in the queue."""
    generated: int | None = None
    """Tokens it generated, set by the gateway once known: `release` charges these instead of
    `cost` (None: `cost` stands)."""


@dataclass(eq=False)
class _Waiter:
    tenant: str
    sequences: int
    cost: float
    order: int
    queued_at: float
    future: asyncio.Future


@dataclass
class TenantLane:
    """One tenant in the queue: its virtual time, waiting requests and sequences in flight."""

    weight: float = 1.0
    pass_: float = 0.0
    """Virtual time: tokens charged / weight, from the virtual time at which it last started waiting."""
    waiting: deque[_Waiter] = field(default_factory=deque)
    in_flight: int = 0
    """Sequences sent and not yet released."""
    active_until: float = float("-inf")
    """When its last request ended plus the queue's `grace_s`: it counts as active until then."""

    def idle(self) -> bool:
        return not self.waiting and not self.in_flight

    def active(self, now: float) -> bool:
        """Wants more: requests waiting, or one ended within the grace (its client about to send
        the next). Requests in flight alone do not count: a tenant with nothing more to send holds
        no share back from the others."""
        return bool(self.waiting) or now < self.active_until


class FairQueue:
    """At most `capacity` engine sequences in flight; the rest wait, served in weighted fair
    order over tokens. `admit` waits for a `Ticket`; `release` gives it back."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic, grace_s: float = 0.0,
                 shares: bool = True):
        if capacity < 1:
            raise ValueError(f"a fair queue needs a capacity of at least 1 sequence, got {capacity}")
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.capacity = capacity
        self.clock = clock
        self.grace_s = grace_s
        self.shares = shares
        """Keep each active tenant within its share (the module docstring); False: fair order only."""
        self._timer: asyncio.TimerHandle | None = None
        self.vtime = 0.0
        """The pass at which the last request was sent: where a tenant that starts waiting starts."""
        self.in_flight = 0
        self._lanes: dict[str, TenantLane] = {}
        self._order = itertools.count()

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight

    def lane(self, tenant: str) -> TenantLane | None:
        return self._lanes.get(tenant)

    def waiting(self, tenant: str | None = None) -> int:
        """Requests waiting (of `tenant`, or of every tenant)."""
        lanes = [self._lanes.get(tenant)] if tenant is not None else list(self._lanes.values())
        return sum(len(lane.waiting) for lane in lanes if lane is not None)

    async def admit(self, tenant: str, sequences: int, cost: float, weight: float = 1.0) -> Ticket:
        """Wait until the request (`sequences` of the engine's, up to `cost` tokens) is the next
        in fair order and fits; returns its ticket. Cancelled while waiting, it leaves the queue."""
        if sequences > self.capacity:
            raise ValueError(f"a request of {sequences} sequences can never fit in {self.capacity}")
        if weight <= 0:
            raise ValueError(f"tenant {tenant}'s weight must be > 0, got {weight}")
        lane = self._lanes.setdefault(tenant, TenantLane())
        lane.weight = weight
        if not lane.waiting:  # starts waiting: no credit for the time it was idle
            lane.pass_ = max(lane.pass_, self.vtime)
        waiter = _Waiter(tenant, sequences, max(1.0, float(cost)), next(self._order), self.clock(),
                         asyncio.get_running_loop().create_future())
        lane.waiting.append(waiter)
        self._send()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # sent just as it was cancelled: give it back
            else:
                with contextlib.suppress(ValueError):   # `_send` may have passed it over already
                    lane.waiting.remove(waiter)
                self._forget_if_idle(tenant)
                self._send()  # the head it blocked may fit now
            raise

    def release(self, ticket: Ticket) -> None:
        """Give `ticket`'s sequences back, charge what it generated instead of its estimate,
        and send whatever now fits."""
        self.in_flight -= ticket.sequences
        lane = self._lanes.get(ticket.tenant)
        if lane is not None:
            lane.in_flight -= ticket.sequences
            lane.active_until = self.clock() + self.grace_s
            if ticket.generated is not None:
                lane.pass_ += (ticket.generated - ticket.cost) / ticket.weight
            self._forget_if_idle(ticket.tenant)
        self._send()

    def _send(self) -> None:
        """Send heads in fair order while the next one fits, each tenant within its share."""
        while True:
            now = self.clock()
            for tenant, lane in list(self._lanes.items()):
                # cancelled: its future is done at once, but its task leaves the queue only when it
                # next runs, maybe after this release; it must not be sent (nor block the order)
                while lane.waiting and lane.waiting[0].future.done():
                    lane.waiting.popleft()
                self._forget_if_idle(tenant)     # its grace is over and it owes nothing
            lanes = sorted((lane for lane in self._lanes.values() if lane.waiting),
                           key=lambda lane: (lane.pass_, lane.waiting[0].order))
            if not lanes:
                return
            within = lanes
            if self.shares:
                active = [lane for lane in self._lanes.values() if lane.active(now)]
                total_weight = sum(lane.weight for lane in active)
                within = [lane for lane in lanes if lane.in_flight == 0 or lane.in_flight + lane.waiting[0].sequences
                          <= math.ceil(self.capacity * lane.weight / total_weight - 1e-9)]
            if not within:
                self._wake_at_grace_end(now, active)   # the free slots wait for active tenants' share
                return
            lane = within[0]
            head = lane.waiting[0]
            if head.sequences > self.free:
                return  # strict order: nothing overtakes the chosen head
            lane.waiting.popleft()
            self.vtime = max(self.vtime, lane.pass_)
            lane.pass_ += head.cost / lane.weight
            lane.in_flight += head.sequences
            self.in_flight += head.sequences
            head.future.set_result(Ticket(head.tenant, head.sequences, head.cost, lane.weight,
                                          self.clock() - head.queued_at))

    def _wake_at_grace_end(self, now: float, active: list[TenantLane]) -> None:
        """Send again once the first grace runs out, when a tenant idle in it stops holding its share."""
        ends = [lane.active_until for lane in active if not lane.waiting]
        if not ends or self.free <= 0:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, min(ends) - now), self._send)

    def _forget_if_idle(self, tenant: str) -> None:
        """Drop an idle tenant's lane once it owes nothing (it would restart at `vtime` anyway);
        keeps the lanes bounded by the tenants active recently."""
        lane = self._lanes.get(tenant)
        if lane is not None and lane.idle() and lane.pass_ <= self.vtime and not lane.active(self.clock()):
            del self._lanes[tenant]


class TenantWeights:
    """Each tenant's fair-share weight (`LearningPolicy.weight` in the registry), read at most
    once per `refresh_s` per tenant, off the event loop. A registry that cannot answer leaves the
    last weight read (1.0 before any), with a warning."""

    def __init__(self, registry: Any, refresh_s: float, clock: Callable[[], float] = time.monotonic):
        self.registry, self.refresh_s, self.clock = registry, refresh_s, clock
        self._read: dict[str, _Weight] = {}

    async def get(self, tenant: str) -> float:
        known = self._read.get(tenant)
        now = self.clock()
        if known is not None and now - known.read_at < self.refresh_s:
            return known.value
        weight = known.value if known is not None else 1.0
        try:
            weight = (await asyncio.to_thread(self.registry.get_tenant, tenant)).policy.weight
        except Exception as e:  # noqa: BLE001 - admission goes on with the last weight; logged
            log.warning("tenant %s's fair-share weight could not be read (%r); using %g for %g s", tenant, e, weight,
                        self.refresh_s)
        self._read[tenant] = _Weight(weight, now)
        return weight


@dataclass(frozen=True)
class _Weight:
    value: float
    read_at: float

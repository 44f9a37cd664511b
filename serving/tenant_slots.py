"""Each tenant's slots: what its requests in flight hold, counted as leases that a request takes
when it is admitted and gives back when it ends.

A `Slot` is one request's lease: its `n` engine sequences and, for a request to a version
other than the tenant's live one (`acme@v3`), that pinned version. `SlotLimits` bounds, per
tenant, the requests, the sequences and the distinct pinned versions in flight; `refusal` says
which limit a new slot would pass.

Two places count them:
- `LocalSlots`: the slots this process holds. Always kept: it is what `Gateway.holds` reports,
  and the count the quota falls back to when Redis cannot be reached.
- `RedisSlots`: every gateway's slots, one sorted set per tenant in Redis, so that a limit holds
  in total across gateway instances. Each lease expires `lease_s` after its last renewal; the
  process that holds it renews it every third of that while its request runs, so a gateway
  killed with requests in flight frees their slots within `lease_s`. Acquire (drop the expired,
  count, check, add), renew and release are each one Lua script: atomic, and on one key (a
  Redis Cluster slot per tenant, by its hash tag).

The `limits` library has rate limits only (hits per window that expire by time), no slots
given back when a request ends, so this counting semaphore is our own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

SLOTS_PREFIX = "clora:gateway:slots:"
"""`SLOTS_PREFIX + "{<tenant>}"`: a sorted set of the tenant's leases, member `Slot.member()`,
score the lease's expiry (ms, Redis's clock). The key itself expires with its last lease."""

Limit = Literal["requests", "sequences", "versions"]


@dataclass(frozen=True)
class SlotLimits:
    """Per tenant, at once: `requests` in flight, `sequences` in flight (the sum of their `n`;
    None: uncounted), distinct `pinned_versions` in flight (None: uncounted)."""

    requests: int
    sequences: int | None = None
    pinned_versions: int | None = None


@dataclass(frozen=True)
class Slot:
    """One request's lease on its tenant's slots."""

    tenant: str
    id: str
    sequences: int
    """The request's `n`: the engine sequences it holds."""
    pinned: int | None
    """The version it holds, when not the tenant's live one (None: the live one or the base)."""

    def member(self) -> str:
        """The lease as a sorted-set member: `"<sequences>:<pinned or 0>:<id>"`, e.g. `"8:3:9f2c..."`."""
        return f"{self.sequences}:{self.pinned or 0}:{self.id}"


@dataclass(frozen=True)
class Occupancy:
    """What a tenant's leases hold. Example: one request of n=1 to the live version and one of
    n=8 to `acme@v3` are `requests` 2, `sequences` 9, `pinned` (3,)."""

    requests: int
    sequences: int
    pinned: tuple[int, ...]
    """Distinct versions other than the live one, ascending."""


@dataclass(frozen=True)
class Taken:
    """The answer to an acquire: `refused` names the limit the slot would pass (None: taken);
    `before` is what the tenant held when it was asked."""

    refused: Limit | None
    before: Occupancy


def refusal(before: Occupancy, slot: Slot, limits: SlotLimits) -> Limit | None:
    """The limit `slot` would pass on top of `before`, checked in this order (None: it fits).
    `ACQUIRE` is the same rule in Lua."""
    if before.requests >= limits.requests:
        return "requests"
    if limits.sequences is not None and before.sequences + slot.sequences > limits.sequences:
        return "sequences"
    if (limits.pinned_versions is not None and slot.pinned is not None and slot.pinned not in before.pinned
            and len(before.pinned) >= limits.pinned_versions):
        return "versions"
    return None


class LocalSlots:
    """The slots this process holds, per tenant (no expiry: they end with the process)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, Slot]] = defaultdict(dict)

    def acquire(self, slot: Slot, limits: SlotLimits | None) -> Taken:
        """Take `slot` unless it passes `limits` (None: take it, counted elsewhere)."""
        before = self.occupancy(slot.tenant)
        refused = refusal(before, slot, limits) if limits is not None else None
        if refused is None:
            self._held[slot.tenant][slot.id] = slot
        return Taken(refused, before)

    def release(self, slot: Slot) -> None:
        held = self._held.get(slot.tenant)
        if held is not None:
            held.pop(slot.id, None)
            if not held:
                del self._held[slot.tenant]

    def held(self, tenant: str) -> list[Slot]:
        return list(self._held.get(tenant, {}).values())

    def occupancy(self, tenant: str) -> Occupancy:
        held = self.held(tenant)
        return Occupancy(len(held), sum(s.sequences for s in held),
                         tuple(sorted({s.pinned for s in held if s.pinned is not None})))


ACQUIRE = """
-- KEYS[1]: a tenant's leases. ARGV: member, sequences, pinned version (0: none), max requests,
-- max sequences (0: uncounted), max pinned versions (0: uncounted), lease ms.
-- Returns {verdict, requests, sequences, pinned versions...} as they were before this lease.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local sequences, seen, pinned = 0, {}, {}
for _, m in ipairs(members) do
  local s, v = string.match(m, '^(%d+):(%d+):')
  sequences = sequences + tonumber(s)
  if v ~= '0' and not seen[v] then seen[v] = true; pinned[#pinned + 1] = tonumber(v) end
end
local ask, version = tonumber(ARGV[2]), ARGV[3]
local max_sequences, max_pinned = tonumber(ARGV[5]), tonumber(ARGV[6])
local verdict = 'taken'
if #members >= tonumber(ARGV[4]) then verdict = 'requests'
elseif max_sequences > 0 and sequences + ask > max_sequences then verdict = 'sequences'
elseif max_pinned > 0 and version ~= '0' and not seen[version] and #pinned >= max_pinned then verdict = 'versions'
end
if verdict == 'taken' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[7]))
end
local out = {verdict, #members, sequences}
for _, v in ipairs(pinned) do out[#out + 1] = v end
return out
"""

RENEW = """
-- KEYS[1]: a tenant's leases. ARGV[1]: lease ms, ARGV[2..]: members this process holds.
-- Extends those still there (an expired one is not brought back); returns how many were.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ms, ARGV[i])
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ms) end
return renewed
"""


def slots_key(tenant: str) -> str:
    return SLOTS_PREFIX + "{" + tenant + "}"


class RedisSlots:
    """Every gateway's slots, in Redis (`SLOTS_PREFIX`), on a `redis.asyncio.Redis` client.
    Renews the leases it granted (a background task on the loop of the first acquire) until
    they are released; `close` stops that. Redis errors propagate to the caller."""

    def __init__(self, client, lease_s: float):
        self.client, self.lease_s = client, lease_s
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self._granted: dict[str, dict[str, Slot]] = defaultdict(dict)
        self._renewer: asyncio.Task | None = None

    async def acquire(self, slot: Slot, limits: SlotLimits) -> Taken:
        out = await self._acquire(keys=[slots_key(slot.tenant)], args=[
            slot.member(), slot.sequences, slot.pinned or 0, limits.requests, limits.sequences or 0,
            limits.pinned_versions or 0, self._lease_ms()])
        verdict = out[0].decode() if isinstance(out[0], bytes) else out[0]
        before = Occupancy(int(out[1]), int(out[2]), tuple(sorted(int(v) for v in out[3:])))
        if verdict != "taken":
            return Taken(verdict, before)
        self._granted[slot.tenant][slot.id] = slot
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_granted(), name="quota-slot-renewal")
        return Taken(None, before)

    def granted(self, slot: Slot) -> bool:
        """Whether this process took `slot` in Redis and has not released it."""
        return slot.id in self._granted.get(slot.tenant, {})

    def forget(self, slot: Slot) -> None:
        """Stop renewing `slot` without releasing it (Redis is down): it expires there."""
        granted = self._granted.get(slot.tenant)
        if granted is not None:
            granted.pop(slot.id, None)
            if not granted:
                del self._granted[slot.tenant]

    async def release(self, slot: Slot) -> None:
        self.forget(slot)
        await self.client.zrem(slots_key(slot.tenant), slot.member())

    async def occupancy(self, tenant: str) -> Occupancy:
        """Every gateway's live leases of `tenant` (expired ones not counted)."""
        now_ms = await self._now_ms()
        members = await self.client.zrangebyscore(slots_key(tenant), f"({now_ms}", "+inf")
        parts = [m.decode().split(":") for m in members]
        return Occupancy(len(parts), sum(int(p[0]) for p in parts),
                         tuple(sorted({int(p[1]) for p in parts if p[1] != "0"})))

    async def renew(self) -> None:
        """Extend every lease this process was granted and has not released."""
        for tenant, granted in list(self._granted.items()):
            members = [s.member() for s in granted.values()]
            if not members:
                continue
            renewed = await self._renew(keys=[slots_key(tenant)], args=[self._lease_ms(), *members])
            if renewed < len(members):
                log.warning("%d of tenant %s's %d quota slots expired in Redis before their renewal (this process "
                            "was stalled past quota_lease_s = %g s or Redis lost them); they count again only "
                            "when their requests end", len(members) - renewed, tenant, len(members), self.lease_s)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer

    async def _renew_granted(self) -> None:
        while self._granted:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew()
            except Exception as e:  # noqa: BLE001 - a failed renewal must not end the loop; the lease may lapse
                log.warning("renewing quota slots in Redis failed (%r); leases expire %g s after their last "
                            "renewal", e, self.lease_s)

    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    async def _now_ms(self) -> int:
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000


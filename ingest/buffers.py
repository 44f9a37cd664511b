"""Per-tenant replay buffers in Redis, and how the learner samples them.

Every key of a tenant carries the tenant in a hash tag (`clora:t:{acme}:...`) so a Redis
Cluster keeps a tenant on one slot and every script below stays single-slot:

    clora:t:{T}:seen            zset  event id -> time       de-duplication (bounded window)
    clora:t:{T}:ix:{iid}        str   interaction JSON        waits for its feedback (TTL)
    clora:t:{T}:pending:{iid}   hash  feedback id -> JSON     feedback that came first (TTL)
    clora:t:{T}:seq             int   example sequence counter
    clora:t:{T}:buf:{kind}      zset  example id -> seq       insertion order, for eviction/sampling
    clora:t:{T}:ex:{kind}       hash  example id -> JSON
    clora:t:{T}:held:{kind}     zset/hash (held:..:ex) the same for held-out examples
    clora:t:{T}:stats           hash  added / evicted / duplicates counters, and
                                      'untrained_feedback:<reason>': scores stored but not
                                      trained on (the tenant's reward spec refused them)
    clora:t:{T}:rewards         hash  per adapter version that served them ('base' for none):
                                      '<v>:n', '<v>:sum', '<v>:sq' of the RL episodes' rewards
    clora:t:{T}:episodes        zset  episode id -> time      episodes already tallied (bounded window)
    clora:t:{T}:served          hash  per adapter version that served them ('base' for none):
                                      '<v>:n', '<v>:empty', '<v>:tool', '<v>:bad_tool', '<v>:chars',
                                      '<v>:chars_sq' of its replies (`clora.ingest.signals`)
    clora:t:{T}:distinct:{v}    hll   fingerprints of version v's first replies (answer diversity)
    clora:t:{T}:prompts:{v}     hll   fingerprints of the prompts those replies answered
    clora:t:{T}:recent          list  the latest feedback records (console)

Writes are Lua scripts, so "is this event new?" and "store its examples" are one atomic
step: a redelivered event is never stored twice, and a crash between two scripts leaves
state that the redelivery completes. The worker queues many of them on one pipeline
(`ReplayBuffer.batch()`); either way the scripts' replies are decoded here, and nothing
outside this module spells a key above.
"""

from __future__ import annotations

import enum
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import redis
from redis.exceptions import NoScriptError
from pydantic import TypeAdapter
from pydantic_core import to_json

from clora.registry import Registry
from clora.ingest.schemas import EXAMPLE_KINDS, Example, InteractionEvent
from clora.ingest.signals import DIVERSITY_WINDOW, ReplyTraits, ServedSignals, sample_variance

Kind = Literal["sft", "preference", "rl"]
_EXAMPLE = TypeAdapter(Example)
RECENT_FEEDBACK = 200


def tkey(tenant: str, *parts: str) -> str:
    return ":".join([f"clora:t:{{{tenant}}}", *parts])


class ParkResult(enum.IntEnum):
    """What `park_feedback` did (the `_PARK_FEEDBACK` script's reply)."""

    PARKED = 1
    DUPLICATE = 0
    INTERACTION_STORED = -1
    """Nothing parked: the interaction is there after all, so join the feedback directly."""


def _stored_flags(raw: bytes) -> list[int]:
    """The reply of `_ADD_EXAMPLES` (b"101": stored, seen, stored) as [1, 0, 1]."""
    return [c - 48 for c in raw]


def _parked_lists(per_interaction: list[list[bytes]]) -> list[list[bytes]]:
    """The reply of `_STORE_INTERACTIONS` (per interaction, HGETALL's flat [id, json, id, json,
    ...]) as each interaction's parked feedback JSON bodies."""
    return [flat[1::2] for flat in per_interaction]


# Stores the examples of several feedback events of one tenant, each at most once.
# KEYS: seen, stats, recent, then per kind (sft, preference, rl): buf, ex, held, held_ex ;
#       seq (KEYS[16]) ; rewards (KEYS[17]) ; episodes (KEYS[18]) ; then the parked-feedback
#       hashes that guards g >= 1 refer to (KEYS[18 + g]) ; last, the tenant's tombstone
#       (`Registry.tombstone_key`): while it exists the tenant is deleted and nothing is stored.
# ARGV: now, capacity, eviction, dedup_window, then the events as one JSON array
#       (`ReplayBuffer._add_call`), then each example's JSON, one argument each:
#       [[event_id, guard, recent_json, untrained, [[kind, id, heldout, body, tally], ...]], ...]
#       guard 0: de-duplicate on the seen set; g > 0: remove from KEYS[18 + g]. recent_json: ''
#       for none. untrained: '' or the reason its score trains nothing (counted in stats as
#       'untrained_feedback:<reason>' when the event is fresh). Per example: kind 0..2, heldout
#       0/1, tally '' or '<version>|<reward>|<episode>' for an RL sample (the episode '' when it
#       has none); body n: the example's JSON is ARGV[5 + n]. The bodies travel as arguments
#       of their own, not inside the array, so neither side escapes or parses them: cjson's
#       decoding of them was 2.4 of the script's 12 Redis CPU-us per event (hiredis packs the
#       arguments in C).
# Each RL sample stored for the first time adds its reward to its serving version's tally (the
# reward guard reads it): a redelivered event counts once, as it stores once. An episode counts
# once too: only the first of its samples to arrive is tallied (episodes zset, trimmed to the
# de-duplication window like `seen`), so a three-turn episode is one observation of its reward.
# Returns one character per event: '1' stored, '0' already seen (one bulk string: a reply of
# thousands of integers costs the client more to parse than the script costs to run).
#
# The script issues a fixed number of commands per call, not per event: one ZMSCORE asks
# which ids were seen, one HMGET per hash which examples exist, then one ZADD/HSET per key
# writes them (sequence numbers in event order, as one INCR per example would give), and
# eviction runs once per buffer after the inserts. Eviction never picks an example inserted
# by the same call unless that call alone overflows the buffer (then the oldest of it go).
# Needs Redis >= 6.2 (ZMSCORE); the embedded server is 6.2. ARGV[3] is 'fifo' or 'random:<seed>'.
_ADD_EXAMPLES = """
local now, cap, eviction, window = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if string.sub(eviction, 1, 7) == 'random:' then math.randomseed(tonumber(string.sub(eviction, 8))) end
local events = cjson.decode(ARGV[5])
local n_events = #events
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return string.rep('0', n_events) end   -- a deleted tenant
local CHUNK = 1000

local function sliced(list, width, fn)     -- fn(first, last) over slices of whole records
  local step = CHUNK * width
  for i = 1, #list, step do fn(i, math.min(i + step - 1, #list)) end
end

-- 1. which unguarded event ids are already known
local unguarded, known = {}, {}
for e = 1, n_events do
  if events[e][2] == 0 then unguarded[#unguarded + 1] = events[e][1] end
end
sliced(unguarded, 1, function(i, j)
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(unguarded, i, j))
  for k = i, j do if scores[k - i + 1] then known[unguarded[k]] = true end end
end)

-- 2. fresh events and their candidate examples, in order
local results, recents, new_seen, cands, by_slot, untrained = {}, {}, {}, {}, {}, {}
local dups = 0
for e = 1, n_events do
  local eid, guard, recent, why, examples = unpack(events[e])
  local fresh
  if guard == 0 then
    fresh = not known[eid]
    if fresh then
      known[eid] = true
      new_seen[#new_seen + 1] = now
      new_seen[#new_seen + 1] = eid
    end
  else
    fresh = redis.call('HDEL', KEYS[18 + guard], eid) == 1
  end
  if fresh then
    if recent ~= '' then recents[#recents + 1] = recent end
    if why ~= '' then untrained[why] = (untrained[why] or 0) + 1 end
    for _, x in ipairs(examples) do
      local slot = 4 + x[1] * 4 + (x[3] == 1 and 2 or 0)   -- KEYS index of buf; ex is next
      cands[#cands + 1] = {slot, x[2], ARGV[5 + x[4]], x[5]}
      local ids = by_slot[slot]
      if not ids then ids = {}; by_slot[slot] = ids end
      ids[#ids + 1] = x[2]
    end
    results[e] = '1'
  else
    dups = dups + 1
    results[e] = '0'
  end
end

-- 3. examples not stored yet get the next sequence numbers, in event order
local exists = {}
for slot, ids in pairs(by_slot) do
  local have = {}
  sliced(ids, 1, function(i, j)
    local bodies = redis.call('HMGET', KEYS[slot + 1], unpack(ids, i, j))
    for k = i, j do if bodies[k - i + 1] then have[ids[k]] = true end end
  end)
  exists[slot] = have
end
local seq = tonumber(redis.call('GET', KEYS[16]) or '0')
local zadds, hsets, inserted, added = {}, {}, {}, 0
local tally, tallied = {}, {}
for _, c in ipairs(cands) do
  local slot, xid, body = c[1], c[2], c[3]
  if not exists[slot][xid] then
    exists[slot][xid] = true
    seq = seq + 1
    added = added + 1
    if c[4] ~= '' then
      local v, r, ep = string.match(c[4], '^([^|]*)|([^|]*)|(.*)$')
      r = tonumber(r)
      if ep == '' or redis.call('ZADD', KEYS[18], 'NX', now, ep) == 1 then
        local t = tally[v]
        if not t then t = {0, 0, 0}; tally[v] = t; tallied[#tallied + 1] = v end
        t[1], t[2], t[3] = t[1] + 1, t[2] + r, t[3] + r * r
      end
    end
    local z, h = zadds[slot], hsets[slot]
    if not z then z, h = {}, {}; zadds[slot], hsets[slot], inserted[slot] = z, h, {} end
    inserted[slot][xid] = true
    z[#z + 1] = seq; z[#z + 1] = xid
    h[#h + 1] = xid; h[#h + 1] = body
  end
end

-- 4. write, then evict down to capacity
local evicted = 0
for slot, z in pairs(zadds) do
  local buf, ex, h = KEYS[slot], KEYS[slot + 1], hsets[slot]
  sliced(h, 2, function(i, j) redis.call('HSET', ex, unpack(h, i, j)) end)
  sliced(z, 2, function(i, j) redis.call('ZADD', buf, unpack(z, i, j)) end)
  local over = redis.call('ZCARD', buf) - cap
  if over > 0 then
    local victims, chosen = {}, {}
    if string.sub(eviction, 1, 7) == 'random:' then
      -- uniform picks by rank with a seed from the caller: Redis 6 reseeds its own PRNG the
      -- same way before every script, so ZRANDMEMBER would pick the same ranks every call
      local mine, card, tries = inserted[slot], redis.call('ZCARD', buf), 0
      while #victims < over and tries < 8 * over + 16 do
        tries = tries + 1
        local r = math.random(0, card - 1)
        local m = redis.call('ZRANGE', buf, r, r)[1]
        if m and not mine[m] and not chosen[m] then
          victims[#victims + 1] = m
          chosen[m] = true
        end
      end
    end
    if #victims < over then   -- fifo, or random when this call's own inserts overflow the buffer
      for _, m in ipairs(redis.call('ZRANGE', buf, 0, over + #victims - 1)) do
        if #victims < over and not chosen[m] then victims[#victims + 1] = m end
      end
    end
    sliced(victims, 1, function(i, j)
      redis.call('ZREM', buf, unpack(victims, i, j))
      redis.call('HDEL', ex, unpack(victims, i, j))
    end)
    evicted = evicted + #victims
  end
end
if added > 0 then redis.call('SET', KEYS[16], seq) end
sliced(new_seen, 2, function(i, j) redis.call('ZADD', KEYS[1], unpack(new_seen, i, j)) end)
for _, k in ipairs({KEYS[1], KEYS[18]}) do
  local over = redis.call('ZCARD', k) - window
  if over > 0 then redis.call('ZREMRANGEBYRANK', k, 0, over - 1) end
end
if #recents > 0 then
  redis.call('LPUSH', KEYS[3], unpack(recents, math.max(1, #recents - %d), #recents))
  redis.call('LTRIM', KEYS[3], 0, %d)
end
for _, v in ipairs(tallied) do
  local t = tally[v]
  redis.call('HINCRBY', KEYS[17], v .. ':n', t[1])
  redis.call('HINCRBYFLOAT', KEYS[17], v .. ':sum', string.format('%%.17g', t[2]))
  redis.call('HINCRBYFLOAT', KEYS[17], v .. ':sq', string.format('%%.17g', t[3]))
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'added', added) end
if evicted > 0 then redis.call('HINCRBY', KEYS[2], 'evicted', evicted) end
if dups > 0 then redis.call('HINCRBY', KEYS[2], 'duplicates', dups) end
for why, n in pairs(untrained) do redis.call('HINCRBY', KEYS[2], 'untrained_feedback:' .. why, n) end
return table.concat(results)
""" % (RECENT_FEEDBACK - 1, RECENT_FEEDBACK - 1)

# KEYS: seen, ix, pending, recent, tombstone ; ARGV: event_id, now, feedback_json, ttl, window, recent_json
# Returns -1 when the interaction is there after all (caller retries the direct path); 0 (as
# for a duplicate) for a deleted tenant.
_PARK_FEEDBACK = """
if redis.call('EXISTS', KEYS[5]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[2]), ARGV[1])
if ARGV[6] ~= '' then
  redis.call('LPUSH', KEYS[4], ARGV[6])
  redis.call('LTRIM', KEYS[4], 0, %d)
end
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[5])
if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1) end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
return 1
""" % (RECENT_FEEDBACK - 1)

# Stores interactions of one tenant, each once, and adds each new one's reply to its version's
# signals as it does (so a redelivered interaction counts once); returns, per interaction, the
# feedback still parked for it (HGETALL's flat [id, json, ...]).
# KEYS: seen, served, then per interaction i = 1.. : ix (KEYS[4i - 1]), pending (KEYS[4i]),
#       distinct (KEYS[4i + 1]), prompts (KEYS[4i + 2]); last, the tenant's tombstone (a deleted
#       tenant: nothing stored, nothing parked returned)
# ARGV: now, ttl, window, diversity window, then the interactions as one JSON array
#       (`ReplayBuffer._store_call`): [[event_id, interaction_json, version, empty 0/1, tool 0/1,
#       bad_tool 0/1, length, fingerprint, prompt fingerprint], ...], version '' for no traits:
#       nothing counted; prompt fingerprint '' for none recorded.
# One call per tenant and poll, its arguments one string (as `_ADD_EXAMPLES`).
_STORE_INTERACTIONS = """
local now, ttl, window, diversity = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local items = cjson.decode(ARGV[5])
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then
  local none = {}
  for i = 1, #items do none[i] = {} end
  return none
end
local ids, known = {}, {}
for i, it in ipairs(items) do ids[i] = it[1] end
for i = 1, #ids, 1000 do
  local j = math.min(i + 999, #ids)
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(ids, i, j))
  for k = i, j do if scores[k - i + 1] then known[ids[k]] = true end end
end
local parked, added = {}, 0
for i, it in ipairs(items) do
  local eid, v = it[1], it[3]
  if not known[eid] then
    known[eid] = true
    added = added + 1
    redis.call('ZADD', KEYS[1], now, eid)
    redis.call('SET', KEYS[4 * i - 1], it[2], 'EX', ttl)
    if v ~= '' then
      local n = redis.call('HINCRBY', KEYS[2], v .. ':n', 1)
      for f, name in ipairs({'empty', 'tool', 'bad_tool'}) do
        if it[3 + f] == 1 then redis.call('HINCRBY', KEYS[2], v .. ':' .. name, 1) end
      end
      local len = it[7]
      redis.call('HINCRBY', KEYS[2], v .. ':chars', len)
      redis.call('HINCRBY', KEYS[2], v .. ':chars_sq', len * len)
      if n <= diversity then
        redis.call('PFADD', KEYS[4 * i + 1], it[8])
        if it[9] ~= '' then redis.call('PFADD', KEYS[4 * i + 2], it[9]) end
      end
    end
  end
  parked[i] = redis.call('HGETALL', KEYS[4 * i])
end
if added > 0 then
  local over = redis.call('ZCARD', KEYS[1]) - window
  if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1) end
end
return parked
"""


@dataclass(frozen=True)
class InteractionWrite:
    """One interaction waiting to be stored (`ReplayBuffer.store_interactions`)."""

    event_id: str
    interaction_id: str
    body: str
    """The interaction's JSON, as the feedback joined with it will read it."""
    traits: ReplyTraits | None = None
    """Its reply's traits, counted in its version's signals when it is new (None: nothing counted)."""


@dataclass(frozen=True)
class BufferPolicy:
    """How a buffer keeps examples. `capacity` is per tenant and kind."""

    capacity: int = 10_000
    eviction: Literal["fifo", "random"] = "fifo"
    dedup_window: int = 1_000_000
    interaction_ttl_s: int = 7 * 24 * 3600
    holdout_fraction: float = 0.1
    """Share of examples (chosen by a hash of their id, so stable) kept out of training for
    evaluation. RL samples are held out by their group id: a group's rollouts stay together,
    because group-normalised advantages need the whole group."""


@dataclass(frozen=True)
class PendingWrite:
    """The examples of one feedback event, waiting to be stored (`ReplayBuffer.add_many`)."""

    event_id: str
    examples: list
    recent: str = ""
    """JSON summary for the tenant's recent-feedback list ('' for none)."""
    parked_for: str | None = None
    """The interaction id whose parked feedback this was (guards on its removal)."""
    untrained: str = ""
    """Why the event's score trains nothing ('' when it trains or has none): counted once, in
    the tenant's stats, when the event is stored (`ReplayBuffer.untrained_feedback`)."""


@dataclass(frozen=True)
class SampleBatch:
    """What `ReplayBuffer.sample` returns.

    Example: a buffer holds seqs 1..10, the learner's cursor is 6, n=4, fresh_fraction=0.5:
    fresh = seqs 7, 8 (oldest new first), old = 2 random picks from seqs 1..6, and
    `cursor` becomes 8, so the next call treats 9 and 10 as fresh.
    """

    examples: list
    cursor: int
    fresh: int
    """How many of `examples` came from after the old cursor."""


@dataclass(frozen=True)
class RewardTally:
    """The rewards of the RL episodes one adapter version served (`ReplayBuffer.version_rewards`;
    a sample that names no episode counts as one)."""

    n: int
    total: float
    squares: float

    @property
    def mean(self) -> float:
        return self.total / self.n

    @property
    def variance(self) -> float:
        """Sample variance (n - 1 in the denominator); 0 for a single sample."""
        return sample_variance(self.n, self.total, self.squares)


def _version_field(version: int | None) -> str:
    """How a serving version is spelled in the per-version keys and fields: `3`, or `base`."""
    return "base" if version is None else str(version)


def _tally(example) -> str:
    """The per-example tally argument of `_ADD_EXAMPLES`: '<version>|<reward>|<episode>' for an
    RL sample ('' for an episode it does not name)."""
    if example.kind != "rl":
        return ""
    return f"{_version_field(example.adapter_version)}|{example.reward!r}|{example.episode_id or ''}"


def holdout_key(example) -> str:
    """What decides an example's train/held-out side: its id, or for RL samples its group id."""
    return example.group_id if example.kind == "rl" else example.example_id


def is_heldout(example_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(example_id.encode(), digest_size=8).digest(), "big")
    return (h % 10_000) < fraction * 10_000


class ReplayBuffer:
    """Writes (for ingest workers) and sampling (for the learner) over the keys above."""

    def __init__(self, client: redis.Redis, policy: BufferPolicy | None = None):
        self.r = client
        self.policy = policy or BufferPolicy()
        self._add = client.register_script(_ADD_EXAMPLES)
        self._park = client.register_script(_PARK_FEEDBACK)
        self._store = client.register_script(_STORE_INTERACTIONS)

    # --- keys -----------------------------------------------------------------------------

    @staticmethod
    def _example_keys(tenant: str) -> list[str]:
        keys = []
        for kind in EXAMPLE_KINDS:
            keys += [tkey(tenant, "buf", kind), tkey(tenant, "ex", kind),
                     tkey(tenant, "held", kind), tkey(tenant, "held", kind, "ex")]
        return keys + [tkey(tenant, "seq"), tkey(tenant, "rewards"), tkey(tenant, "episodes")]  # KEYS[4..18]

    # --- writes (ingest worker) -----------------------------------------------------------

    def batch(self) -> "BufferBatch":
        """Writes to queue on one pipeline, sent in one round trip by `BufferBatch.execute`."""
        return BufferBatch(self)

    def store_interaction(self, tenant: str, event_id: str, interaction_id: str, body: str,
                          *, now: float, traits: ReplyTraits | None = None) -> list[bytes]:
        """Store an interaction (once), and count its reply's `traits` in its version's signals
        when the interaction is new. Returns the JSON of the feedback parked for it."""
        return self.store_interactions(tenant, [InteractionWrite(event_id, interaction_id, body, traits)], now=now)[0]

    def store_interactions(self, tenant: str, items: list[InteractionWrite], *, now: float) -> list[list[bytes]]:
        """`store_interaction` for several interactions of one tenant, in one script call:
        per interaction, the JSON of the feedback parked for it."""
        return self._run(self._store_call(tenant, items, now=now))

    def park_feedback(self, tenant: str, event_id: str, interaction_id: str, body: str,
                      *, now: float, recent: str = "") -> ParkResult:
        """Park feedback whose interaction has not arrived (it shows in the recent list now;
        its examples come when the interaction does)."""
        return self._run(self._park_call(tenant, event_id, interaction_id, body, now=now, recent=recent))

    def add_examples(self, tenant: str, event_id: str, examples: list, *, now: float,
                     recent: str = "", parked_for: str | None = None, capacity: int | None = None) -> int:
        """Store the examples built from one feedback event, atomically and at most once.
        Returns 1 stored, 0 already seen (see `add_many`)."""
        item = PendingWrite(event_id, examples, recent, parked_for)
        return self.add_many(tenant, [item], now=now, capacity=capacity)[0]

    def add_many(self, tenant: str, items: list["PendingWrite"], *, now: float,
                 capacity: int | None = None) -> list[int]:
        """Store the examples of several feedback events of one tenant in one script call.

        Each event de-duplicates on its id (or, with `parked_for`, on removing it from that
        interaction's parked feedback). Returns 1 (stored) or 0 (seen) per item.
        """
        return self._run(self._add_call(tenant, items, now=now, capacity=capacity))

    def stored_interactions(self, refs: list[tuple[str, str]]) -> list[InteractionEvent | None]:
        """The stored interaction of each (tenant, interaction id), None where it has not arrived
        or has expired; one round trip for all, each distinct interaction parsed once."""
        raws = self.stored_interaction_bodies(refs)
        parsed: dict[bytes, InteractionEvent] = {}
        for raw in raws:
            if raw is not None and raw not in parsed:
                parsed[raw] = InteractionEvent.model_validate_json(raw)
        return [None if raw is None else parsed[raw] for raw in raws]

    def stored_interaction_bodies(self, refs: list[tuple[str, str]]) -> list[bytes | None]:
        """The stored JSON of each (tenant, interaction id), as `stored_interactions` reads it."""
        return self.r.mget([tkey(tenant, "ix", iid) for tenant, iid in refs]) if refs else []

    def _run(self, call: "_ScriptCall"):
        return call.decode(call.script(keys=call.keys, args=call.args))

    def _store_call(self, tenant: str, items: list[InteractionWrite], *, now: float) -> "_ScriptCall":
        keys = [tkey(tenant, "seen"), tkey(tenant, "served")]
        rows = []
        for item in items:
            t = item.traits
            version = "" if t is None else _version_field(t.version)
            keys += [tkey(tenant, "ix", item.interaction_id), tkey(tenant, "pending", item.interaction_id),
                     tkey(tenant, "distinct", version or "none"), tkey(tenant, "prompts", version or "none")]
            rows.append([item.event_id, item.body, version] + ([0, 0, 0, 0, "", ""] if t is None else
                        [int(t.empty), int(t.tool_call), int(t.bad_tool_call), t.length, t.fingerprint,
                         t.prompt_fingerprint]))
        keys.append(Registry.tombstone_key(tenant))
        args = [now, self.policy.interaction_ttl_s, self.policy.dedup_window, DIVERSITY_WINDOW, to_json(rows)]
        return _ScriptCall(self._store, keys, args, _parked_lists)

    def _park_call(self, tenant: str, event_id: str, interaction_id: str, body: str, *, now: float,
                   recent: str) -> "_ScriptCall":
        keys = [tkey(tenant, "seen"), tkey(tenant, "ix", interaction_id), tkey(tenant, "pending", interaction_id),
                tkey(tenant, "recent"), Registry.tombstone_key(tenant)]
        args = [event_id, now, body, self.policy.interaction_ttl_s, self.policy.dedup_window, recent]
        return _ScriptCall(self._park, keys, args, ParkResult)

    def _add_call(self, tenant: str, items: list["PendingWrite"], *, now: float,
                  capacity: int | None) -> "_ScriptCall":
        keys = [tkey(tenant, "seen"), tkey(tenant, "stats"), tkey(tenant, "recent")] + self._example_keys(tenant)
        guards: dict[str, int] = {}
        eviction = "fifo" if self.policy.eviction == "fifo" else f"random:{random.getrandbits(31)}"
        events, bodies = [], []
        for item in items:
            guard = 0
            if item.parked_for is not None:
                if item.parked_for not in guards:
                    guards[item.parked_for] = len(guards) + 1
                    keys.append(tkey(tenant, "pending", item.parked_for))
                guard = guards[item.parked_for]
            examples = []
            for ex in item.examples:
                bodies.append(ex.model_dump_json())
                examples.append([EXAMPLE_KINDS.index(ex.kind), ex.example_id,
                                 int(is_heldout(holdout_key(ex), self.policy.holdout_fraction)), len(bodies), _tally(ex)])
            events.append([item.event_id, guard, item.recent, item.untrained, examples])
        keys.append(Registry.tombstone_key(tenant))
        args = [now, capacity or self.policy.capacity, eviction, self.policy.dedup_window, to_json(events), *bodies]
        return _ScriptCall(self._add, keys, args, _stored_flags)

    # --- reads (learner, console, metrics) ------------------------------------------------

    def depth(self, tenant: str, kind: Kind, *, heldout: bool = False) -> int:
        return self.r.zcard(tkey(tenant, "held" if heldout else "buf", kind))

    def newer_than(self, tenant: str, kind: Kind, cursor: int) -> int:
        return self.r.zcount(tkey(tenant, "buf", kind), f"({cursor}", "+inf")

    def stats(self, tenant: str) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(tkey(tenant, "stats")).items()}

    def untrained_feedback(self, tenant: str) -> dict[str, int]:
        """Scores stored but not trained on, by reason (`PendingWrite.untrained`)."""
        prefix = "untrained_feedback:"
        return {k[len(prefix):]: n for k, n in self.stats(tenant).items() if k.startswith(prefix)}

    def version_rewards(self, tenant: str) -> dict[int | None, RewardTally]:
        """Per adapter version (None: the base model), the rewards of the RL episodes it served
        whose samples reached the buffer (held-out ones too; evicted ones still count), an
        episode counted once, at the version of its first sample to arrive."""
        fields: dict[int | None, dict[str, float]] = {}
        for k, v in self.r.hgetall(tkey(tenant, "rewards")).items():
            version, _, stat = k.decode().rpartition(":")
            fields.setdefault(None if version == "base" else int(version), {})[stat] = float(v)
        return {v: RewardTally(int(f.get("n", 0)), f.get("sum", 0.0), f.get("sq", 0.0))
                for v, f in fields.items() if f.get("n")}

    def served_signals(self, tenant: str) -> dict[int | None, ServedSignals]:
        """Per adapter version (None: the base model), what its served replies looked like
        (`clora.ingest.signals`): every interaction stored counts once, at the version that
        served it."""
        fields: dict[int | None, dict[str, int]] = {}
        for k, v in self.r.hgetall(tkey(tenant, "served")).items():
            version, _, stat = k.decode().rpartition(":")
            fields.setdefault(None if version == "base" else int(version), {})[stat] = int(v)
        versions = [v for v, f in fields.items() if f.get("n")]
        pipe = self.r.pipeline(transaction=False)
        for v in versions:
            pipe.pfcount(tkey(tenant, "distinct", _version_field(v)))
            pipe.pfcount(tkey(tenant, "prompts", _version_field(v)))
        counts = pipe.execute()
        return {v: ServedSignals(n=fields[v]["n"], empty=fields[v].get("empty", 0),
                                 tool_calls=fields[v].get("tool", 0), bad_tool_calls=fields[v].get("bad_tool", 0),
                                 chars=fields[v].get("chars", 0), chars_sq=fields[v].get("chars_sq", 0),
                                 distinct=distinct, prompts=prompts)
                for v, distinct, prompts in zip(versions, counts[::2], counts[1::2])}

    def recent_feedback(self, tenant: str, n: int = 50) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(tkey(tenant, "recent"), 0, n - 1)]

    def interactions(self, tenant: str, interaction_ids: list[str]) -> list[InteractionEvent | None]:
        """Stored interactions (None where expired or never seen), in the order asked."""
        return self.stored_interactions([(tenant, i) for i in interaction_ids])

    def heldout(self, tenant: str, kind: Kind, n: int | None = None) -> list:
        """The oldest `n` held-out examples (all of them when n is None), oldest first. Not the
        newest: on RL those are the live version's own samples, which it scores better than any
        candidate, so a gate on them would refuse every new version."""
        ids = self.r.zrange(tkey(tenant, "held", kind), 0, -1 if n is None else n - 1)
        return self._load(tkey(tenant, "held", kind, "ex"), ids)

    def latest(self, tenant: str, kind: Kind, n: int = 20) -> list:
        ids = self.r.zrevrange(tkey(tenant, "buf", kind), 0, n - 1)
        return self._load(tkey(tenant, "ex", kind), ids)

    def sample(self, tenant: str, kind: Kind, n: int, *, cursor: int = 0,
               fresh_fraction: float = 0.5, seed: int | None = None, fill: bool = True) -> SampleBatch:
        """Up to `n` examples: about `fresh_fraction` of them the oldest not yet seen (seq >
        cursor), the rest uniformly from older data; either side fills the other's shortfall.
        With `fill=False` neither side fills the other's shortfall: `fresh_fraction=1` then
        gives only examples past the cursor (on-policy RL), however few."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not 0.0 <= fresh_fraction <= 1.0:
            raise ValueError(f"fresh_fraction must be in [0, 1], got {fresh_fraction}")
        buf = tkey(tenant, "buf", kind)
        n_old_avail = self.r.zcount(buf, "-inf", cursor)
        want_fresh = max(0, min(n, round(n * fresh_fraction)))
        if fill and n_old_avail < n - want_fresh:
            want_fresh = n - n_old_avail
        fresh = self.r.zrangebyscore(buf, f"({cursor}", "+inf", start=0, num=want_fresh, withscores=True) if want_fresh else []
        n_old = min(n - len(fresh) if fill else n - want_fresh, n_old_avail)
        rng = random.Random(seed)
        ranks = rng.sample(range(n_old_avail), n_old) if n_old else []
        pipe = self.r.pipeline()
        for rank in ranks:
            pipe.zrange(buf, rank, rank)
        old_ids = [ids[0] for ids in pipe.execute() if ids]
        new_cursor = int(fresh[-1][1]) if fresh else cursor
        examples = self._load(tkey(tenant, "ex", kind), [i for i, _ in fresh] + old_ids)
        return SampleBatch(examples=examples, cursor=new_cursor, fresh=len(fresh))

    def _load(self, hash_key: str, ids: list) -> list:
        if not ids:
            return []
        raws = self.r.hmget(hash_key, ids)
        # An id can vanish between the two reads if it was evicted meanwhile: skip it.
        return [_EXAMPLE.validate_json(raw) for raw in raws if raw is not None]

    def depths(self, tenants: list[str]) -> dict[str, dict[str, int]]:
        """Each tenant's training-buffer depth per kind (`{"acme": {"sft": 3, "preference": 1,
        "rl": 0}}`), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for tenant in tenants:
            for kind in EXAMPLE_KINDS:
                pipe.zcard(tkey(tenant, "buf", kind))
        counts = iter(pipe.execute())
        return {tenant: {kind: next(counts) for kind in EXAMPLE_KINDS} for tenant in tenants}

    def tenants_with_data(self) -> list[str]:
        """Tenants that have a stats hash (had at least one example). For metrics: it scans the
        whole keyspace, so callers run it seldom."""
        out = []
        for key in self.r.scan_iter(match=tkey("*", "stats"), count=10_000):
            k = key.decode()
            out.append(k[k.index("{") + 1:k.index("}")])
        return sorted(out)

    def delete_tenant(self, tenant: str) -> int:
        """Delete every key of `tenant` above (buffers, held-out sets, parked feedback, stats,
        rewards, served signals, recent feedback): a deleted tenant's data. Safe to repeat;
        returns how many keys it deleted. Its tombstone stays (`Registry.tombstone_key`): while
        it does, the write scripts store nothing more for the tenant."""
        if not tenant or any(c in tenant for c in "*?[]{}\\"):   # the SCAN pattern must name one tenant
            raise ValueError(f"{tenant[:100]!r} is not a tenant id")
        deleted, batch = 0, []
        tombstone = Registry.tombstone_key(tenant).encode()
        for key in self.r.scan_iter(match=tkey(tenant, "*"), count=1000):
            if key == tombstone:       # set by the registry's retire: it keeps the buffers deleted
                continue
            batch.append(key)
            if len(batch) >= 500:
                deleted += self.r.unlink(*batch)
                batch = []
        return deleted + (self.r.unlink(*batch) if batch else 0)


@dataclass(frozen=True)
class _ScriptCall:
    """One call of a write script, and how to read its reply."""

    script: Any
    keys: list[str]
    args: list
    decode: Callable[[Any], Any]


SCRIPT_CHUNK = 128
"""Most events one write-script call of a `BufferBatch` takes. Redis runs one script at a time
and nothing else meanwhile: a worker's 500-event call held its next batch's read (the MGET of
the interactions to join) for the whole call, so the worker's Python and Redis took turns
instead of working side by side. At 128 a call lasts 1-2 ms; chunks cost Redis about 1 CPU-us
more per event than whole polls, and a worker's batched rate rose from 24k to 28k events/s
(`benchmarks/bench_ingest.py`, one tenant; 64 gave 25-26.5k)."""


class BufferBatch:
    """Buffer writes queued on one Redis pipeline (not a transaction: each script is atomic on
    its own). `execute` sends them and returns each call's result, decoded as the immediate
    `ReplayBuffer` method of the same name returns it, in the order they were queued. A call of
    many events is sent as several script calls of `SCRIPT_CHUNK` events, its result put together
    again."""

    def __init__(self, buffers: ReplayBuffer):
        self._buffers = buffers
        self._pipe = buffers.r.pipeline(transaction=False)
        self._calls: list[list[_ScriptCall]] = []

    def store_interaction(self, tenant: str, event_id: str, interaction_id: str, body: str, *, now: float,
                          traits: ReplyTraits | None = None) -> None:
        call = self._buffers._store_call(tenant, [InteractionWrite(event_id, interaction_id, body, traits)], now=now)
        self._queue(replace(call, decode=lambda reply: _parked_lists(reply)[0]))

    def store_interactions(self, tenant: str, items: list[InteractionWrite], *, now: float) -> None:
        self._queue(*(self._buffers._store_call(tenant, chunk, now=now) for chunk in _chunks(items)))

    def park_feedback(self, tenant: str, event_id: str, interaction_id: str, body: str,
                      *, now: float, recent: str = "") -> None:
        self._queue(self._buffers._park_call(tenant, event_id, interaction_id, body, now=now, recent=recent))

    def add_many(self, tenant: str, items: list[PendingWrite], *, now: float, capacity: int | None = None) -> None:
        self._queue(*(self._buffers._add_call(tenant, chunk, now=now, capacity=capacity) for chunk in _chunks(items)))

    def execute(self) -> list:
        """Send the queued calls by their scripts' SHA1s. redis-py's own pipelined `Script` would
        first ask `SCRIPT EXISTS` on every execute, a round trip per batch; instead a Redis that
        lost its script cache (a restart, `SCRIPT FLUSH`) answers NOSCRIPT, and the scripts are
        loaded and the whole batch sent again: each write script stores an event once, so the
        calls that did run before store nothing twice."""
        try:
            replies = self._pipe.execute()
        except NoScriptError:
            calls = [call for parts in self._calls for call in parts]
            for script in {id(c.script): c.script for c in calls}.values():
                self._buffers.r.script_load(script.script)
            self._pipe = self._buffers.r.pipeline(transaction=False)
            for call in calls:
                self._send(call)
            replies = self._pipe.execute()
        replies_left = iter(replies)
        results = []
        for parts in self._calls:
            decoded = [call.decode(next(replies_left)) for call in parts]
            results.append(decoded[0] if len(decoded) == 1 else [x for part in decoded for x in part])
        return results

    def _queue(self, *parts: _ScriptCall) -> None:
        """One call, sent as `parts` (chunks whose decoded lists join into its result)."""
        self._calls.append(list(parts))
        for call in parts:
            self._send(call)

    def _send(self, call: _ScriptCall) -> None:
        self._pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)


def _chunks(items: list) -> list[list]:
    """`items` in runs of at most `SCRIPT_CHUNK` (one run, maybe empty, for a short list)."""
    return [items[i:i + SCRIPT_CHUNK] for i in range(0, len(items), SCRIPT_CHUNK)] or [items]

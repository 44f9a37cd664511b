"""What a tenant's next step trains on: `Sampler` draws it from the replay buffer.

A draw takes `batch_size` examples: about the tenant's `fresh_fraction` (else the learner's)
the oldest past its cursor, the rest replayed from older data with a seed from the tenant's
own generator. On-policy RL takes only the oldest `batch_size` examples past the cursor: no
random draw, so the same call gives the same batch until the cursor moves.

An RL batch in which no group has a reward spread has advantage 0 everywhere: no gradient,
yet an optimizer step would still move the weights along Adam's old momentum. Such a "flat"
batch is consumed (the cursor moves past it) without a step (`consume_if_flat`), and before
the scheduler picks who trains every eligible on-policy tenant's batch is checked once
(`skip_flat`): a flat batch costs a buffer read, not a step, so it must not wait in the queue
behind other tenants' steps while its tenant's next rollouts wait for it.

A flat verdict holds only for whole groups, and the learner cannot tell a whole group from
the start of one: an ingest poll can store part of a group's rewards, and a batch's cut can
split a group. Consumed, the start of a group could never be judged with the rest of it, and
the rest, fewer than the tenant's `min_new_examples`, would wait for the next rollouts while
those wait for a version from it. So an on-policy flat batch is consumed only up to its newest
group (`flat_cut`); that group's samples wait to be judged with what follows them. A tenant
whose whole batch is such a group is held: not offered to the scheduler until its batch
changes (`LearnerTenant.flat_held`).

A mixed step (`auto`: corrections, pairs and scored samples together) takes the oldest
`batch_size` examples past the cursor over all its kinds, in the buffer's sequence order (one
counter per tenant across kinds), each trained once: `fresh_across`. Replaying older examples
into a mixed step is not done yet.

Also owns `BufferLike`, the replay buffer as the learner reads it.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Protocol

import torch

from clora.learner.adapter_store import AdapterStore
from clora.learner.losses import has_reward_spread
from clora.learner.metrics import LearnerMetrics
from clora.learner.scheduler import Scheduler, TenantView
from clora.learner.settings import LearnerSettings
from clora.learner.tenant import LearnerTenant
from clora.learner.trainer import EXAMPLE_KINDS, Example, TrainingPolicy

log = logging.getLogger(__name__)


class BufferLike(Protocol):
    def sample(self, tenant: str, kind: str, n: int, *, cursor: int = 0, fresh_fraction: float = 0.5,
               seed: int | None = None, fill: bool = True): ...
    def newer_than(self, tenant: str, kind: str, cursor: int) -> int: ...
    def heldout(self, tenant: str, kind: str, n: int | None = None) -> list: ...
    def version_rewards(self, tenant: str) -> dict: ...
    def served_signals(self, tenant: str) -> dict: ...


@dataclass(frozen=True)
class Draw:
    """One tenant's batch for its next step. Example: acme (SFT, batch size 4, cursor 8) draws
    `Draw("acme", policy, batch, examples)` with `batch.cursor` 12 (the newest example in it)
    and `examples` its 4 SFT examples; after the step acme's cursor is 12."""

    tenant: str
    policy: TrainingPolicy
    batch: object
    """The buffer's sample: `.examples` and `.cursor`, where the tenant's cursor moves to."""
    examples: list[Example]
    """The batch's examples of the policy's kind (empty: nothing to train on)."""

    @property
    def fresh(self) -> list[Example]:
        """The examples this step trains on first (from past the tenant's cursor); the others
        are replays, first trained in an earlier step. A buffer's sample lists its `fresh` first;
        a mixed draw's (`fresh_across`) are all fresh. Example: cursor 8, batch size 4, 2 new
        examples -> `fresh` is seqs 9 and 10, the 2 replayed ones are not."""
        return self.examples[:self.batch.fresh]


@dataclass(frozen=True)
class BatchSeen:
    """The point a tenant's batch was checked for a reward spread at: it is checked again only
    once one of these changes. Example: `BatchSeen(cursor=8, waiting=8, batch_size=8)`."""

    cursor: int
    waiting: int
    batch_size: int


class Sampler:
    def __init__(self, settings: LearnerSettings, buffer: BufferLike, store: AdapterStore, scheduler: Scheduler,
                 metrics: LearnerMetrics, tenants: MutableMapping[str, LearnerTenant]):
        self.s = settings
        self.buffer = buffer
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.tenants = tenants

    def on_policy(self, policy: TrainingPolicy) -> bool:
        return policy.algorithm == "rl" and self.s.rl_on_policy

    def draw(self, tid: str, policy: TrainingPolicy) -> Draw:
        """The batch of `tid`'s next step (see the module docstring)."""
        kinds = EXAMPLE_KINDS[policy.algorithm]
        st = self.store.peek(tid)
        if len(kinds) > 1:
            batch = fresh_across(self.buffer, tid, kinds, policy.batch_size, st.cursor)
            return Draw(tid, policy, batch, list(batch.examples))
        kind = kinds[0]
        on_policy = self.on_policy(policy)
        seed = None
        if not on_policy:
            gen = st.generator()
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            st.save_generator(gen)
        fresh = 1.0 if on_policy else policy.fresh_fraction if policy.fresh_fraction is not None else self.s.fresh_fraction
        batch = self.buffer.sample(tid, kind, policy.batch_size, cursor=st.cursor, seed=seed,
                                   fresh_fraction=fresh, fill=not on_policy)
        return Draw(tid, policy, batch, [e for e in batch.examples if e.kind == kind])

    def skip_flat(self, views: list[TenantView], policies: dict[str, TrainingPolicy]) -> bool:
        """Consume every eligible on-policy RL tenant's flat batch, before the scheduler picks
        who trains (`policies`: those of the eligible tenants). A batch is checked once per
        `BatchSeen`. Returns whether any was flat: consumed or held (the views are then stale)."""
        flat = False
        for v in views:
            policy = policies[v.id] if v.eligible else None
            if policy is None or not self.on_policy(policy):
                continue
            seen = BatchSeen(self.store.peek(v.id).cursor, v.waiting, policy.batch_size)
            record = self.tenants[v.id]
            if record.flat_checked == seen:
                continue
            record.flat_checked = seen
            draw = self.draw(v.id, policy)
            flat |= bool(draw.examples) and self.consume_if_flat(draw)
        return flat

    def consume_if_flat(self, draw: Draw) -> bool:
        """Whether `draw` is a flat RL batch, which takes no step. Its samples are then consumed
        (the cursor moves past them) as far as `flat_cut` allows; when it allows none, the tenant
        is held until its batch changes (`LearnerTenant.flat_held`)."""
        if draw.policy.algorithm != "rl" or has_reward_spread([e.reward for e in draw.examples],
                                                              [e.group_id for e in draw.examples]):
            return False
        st = self.store.peek(draw.tenant)
        n = self.flat_cut(draw) if self.on_policy(draw.policy) else len(draw.examples)
        if n == 0:
            # all `draw.examples` were waiting (`flat_cut` holds back only a batch short of full)
            self.tenants[draw.tenant].flat_held = BatchSeen(st.cursor, len(draw.examples), draw.policy.batch_size)
            log.info("holding %s: its %d samples, one group without a reward spread so far, wait for more",
                     draw.tenant, len(draw.examples))
            return True
        kinds = (draw.examples[0].kind,)
        st.cursor = max(st.cursor, draw.batch.cursor if n == len(draw.examples) else
                        cut(self.buffer, draw.tenant, kinds, st.cursor, draw.batch.cursor, n))
        self.tenants[draw.tenant].dirty = True
        self.scheduler.record(draw.tenant, 0.0)
        self.metrics.flat_batches.labels(draw.tenant).inc()
        log.info("skipped %s: no group among its %d samples has a reward spread (%d consumed, its newest group's "
                 "%d wait)", draw.tenant, len(draw.examples), n, len(draw.examples) - n)
        return True

    def flat_cut(self, draw: Draw) -> int:
        """How many of on-policy flat batch `draw`'s samples, oldest first, to consume: those before
        its newest group (the group of its newest sample), which may be incomplete, unless a sample
        of another group lies past the batch (the group is complete) or the group fills the batch
        alone (waiting would not change the batch). Example: batch size 8, groups a a a a b b b b
        -> 4 (b waits); a sample of c past the batch -> 8; b b b b alone -> 0 (the tenant is held);
        b b b b b b b b -> 8."""
        examples = draw.examples
        newest = examples[-1].group_id
        first = next(i for i, e in enumerate(examples) if e.group_id == newest)
        past = self.buffer.sample(draw.tenant, examples[0].kind, 1, cursor=draw.batch.cursor, fresh_fraction=1.0,
                                  fill=False).examples
        if (past and past[0].group_id != newest) or (first == 0 and len(examples) >= draw.policy.batch_size):
            return len(examples)
        return first


@dataclass(frozen=True)
class MixedSample:
    """A mixed step's batch (`fresh_across`), read as a buffer's sample is. Example: cursor 8,
    n 4, SFT seqs 9, 12 and RL seqs 10, 11, 13 waiting -> `examples` the SFT 9, 12 and RL
    10, 11, `cursor` 12, `fresh` 4."""

    examples: list
    cursor: int
    fresh: int


def fresh_across(buffer: BufferLike, tenant: str, kinds: tuple[str, ...], n: int, cursor: int) -> MixedSample:
    """The oldest `n` examples past `cursor` over `kinds` (fewer when fewer wait), and the cursor
    after them. Each kind's oldest `n` are read; the cut is the largest sequence number c with
    at most `n` examples of all kinds in (cursor, c], found by bisection on `newer_than`
    counts, so no example is skipped: whatever is not taken now is past the new cursor."""
    batches = {k: buffer.sample(tenant, k, n, cursor=cursor, fresh_fraction=1.0, fill=False) for k in kinds}
    waiting = {k: buffer.newer_than(tenant, k, cursor) for k in kinds}
    lo = cut(buffer, tenant, kinds, cursor, max(b.cursor for b in batches.values()), n, waiting)
    examples = [e for k in kinds for e in batches[k].examples[:waiting[k] - buffer.newer_than(tenant, k, lo)]]
    return MixedSample(examples, lo, len(examples))


def cut(buffer: BufferLike, tenant: str, kinds: tuple[str, ...], cursor: int, hi: int, n: int,
        waiting: dict[str, int] | None = None) -> int:
    """The cursor after the oldest `n` examples of `kinds` past `cursor`: the largest sequence
    number c in [cursor, hi] with at most `n` of them in (cursor, c], found by bisection on
    `newer_than` counts (`waiting`: each kind's count past `cursor`, when already read).
    Example: rl seqs 9, 10, 12, 15 past cursor 8, n 2, hi 15 -> 11."""
    waiting = waiting if waiting is not None else {k: buffer.newer_than(tenant, k, cursor) for k in kinds}

    def taken(c: int) -> int:  # examples of every kind with a sequence number in (cursor, c]
        return sum(waiting[k] - buffer.newer_than(tenant, k, c) for k in kinds)

    lo = cursor
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if taken(mid) <= n else (lo, mid - 1)
    return lo

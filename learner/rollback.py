"""Rolling a tenant back when the reward guard says so: `RewardRollback`.

Every `reward_guard_interval_s`, each unpaused tenant's live version is judged on the rewards
it served against its newest well-measured ancestor's (`reward_guard.judge`, the decision
itself), whether or not the tenant has data to train on. A measurable drop makes the
ancestor live again, notes the rollback on the bad version's record, and the tenant trains on
from the restored version's weights. A version an operator made live again after the guard
rolled it back is left alone. A failure here is logged and never stops training.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from clora.learner.lifecycle import TenantLifecycle
from clora.learner.metrics import LearnerMetrics, append_history
from clora.learner.publish import Publisher
from clora.learner.reward_guard import GuardSettings, GuardVerdict, judge, measured
from clora.learner.sampling import BufferLike
from clora.learner.settings import LearnerSettings

log = logging.getLogger(__name__)


class RewardRollback:
    def __init__(self, settings: LearnerSettings, registry, buffer: BufferLike, publisher: Publisher,
                 lifecycle: TenantLifecycle, metrics: LearnerMetrics):
        self.s = settings
        self.registry = registry
        self.buffer = buffer
        self.publisher = publisher
        self.lifecycle = lifecycle
        self.store = lifecycle.store
        self.metrics = metrics
        self._guarded_at = -float("inf")
        """Monotonic time of the last round."""

    def round(self, tenants: dict) -> None:
        """Run the reward guard over every unpaused tenant (registry tenants by id), at most
        every `reward_guard_interval_s`."""
        now = time.monotonic()
        if now - self._guarded_at < self.s.reward_guard_interval_s:
            return
        self._guarded_at = now
        for t in tenants.values():
            if not t.policy.paused:
                self.guard(t)

    def guard(self, tenant) -> GuardVerdict | None:
        """Judge `tenant`'s live version on the rewards it served (`reward_guard.judge`); on a
        measurable drop, roll it back and train on from the restored version's weights.
        Returns the verdict (None when the guard is off or nothing is live). A failure here is
        logged and never stops training."""
        p = tenant.policy
        if not p.reward_guard or (live := self.registry.live_version(tenant.id)) is None:
            return None
        try:
            tallies = self.buffer.version_rewards(tenant.id)
            versions = ({v.version: v for v in self.registry.adapter_versions(tenant.id)}   # only read when
                        if measured(tallies.get(live), p.reward_guard_min_samples) else {})  # judge will need them
            verdict = judge(live, {v: meta.parent_version for v, meta in versions.items()}, tallies,
                            GuardSettings(p.reward_guard_min_samples, p.reward_guard_margin, self.s.reward_guard_z))
            if verdict.rollback and versions[live].rolled_back is not None:   # the guard rolled it back once,
                return dataclasses.replace(verdict, rollback=False, reason=(   # then someone made it live again
                    f"v{live} was made live again after the reward guard rolled it back; left as it is"))
            if verdict.rollback:
                self._roll_back(tenant.id, versions[live], verdict)
            return verdict
        except Exception:  # noqa: BLE001 - the guard protects serving; it must not stop training
            log.exception("reward guard of %s failed", tenant.id)
            return None

    def _roll_back(self, tenant: str, bad, verdict: GuardVerdict) -> None:
        """Restore the reference's weights (checkpointed), make it live, then note it on the bad
        version. A crash part way leaves a state the next round finishes or accepts: weights
        restored but the bad version still live -> the guard trips again (restoring is
        idempotent); live switched but no note -> only the note is lost."""
        self.lifecycle.restore_weights(tenant, self.publisher.weights(tenant, verdict.reference),  # unreadable: raises
                                       verdict.reference)
        target = self.publisher.rollback(tenant, verdict.reference)
        self.registry.mark_rolled_back(tenant, bad.version,
                                       {"time": time.time(), "to": verdict.reference, **verdict.summary()})
        self.metrics.reward_rollbacks.labels(tenant).inc()
        # own keys: "reward" is a step's batch reward (the console's reward chart) and "version" a
        # publish (the experiment bench waits for one)
        append_history(self.registry, tenant, {"step": self.store.peek(tenant).step, "rolled_back": bad.version,
                                               "live": target.version, "served_reward": verdict.live_reward.mean,
                                               "reference_served_reward": verdict.reference_reward.mean})
        log.warning("reward guard rolled %s back from v%d to v%d: %s", tenant, bad.version, target.version,
                    verdict.reason)

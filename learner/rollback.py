"""Rolling a tenant back when the reward guard or the reward-hacking guard says so:
`RewardRollback`.

Every `reward_guard_interval_s`, each unpaused tenant's live version is judged on the rewards
it served against its newest well-measured ancestor's (`reward_guard.judge`, the decision
itself), whether or not the tenant has data to train on. A measurable drop makes the
ancestor live again, notes the rollback on the bad version's record, and the tenant trains on
from the restored version's weights.

Then, unless that rolled it back, the reward-hacking guard judges the same version on what its
replies looked like (`hacking_guard.judge`): rewards that held up while the replies
degenerated make the ancestor live again too, and also pause the tenant (with the reason in
its policy's `paused_reason`), record an alert for the console (`Registry.record_alert`) and
count it (`clora_learner_reward_hacking_total`). A paused tenant trains no more until an
operator resumes it: the reward that paid for the degenerate replies would pay for them again.

A version an operator made live again after a guard rolled it back is left alone. A failure
here is logged and never stops training.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from clora.registry import TenantAlert
from clora.learner.hacking_guard import HackingSettings, HackingVerdict
from clora.learner.hacking_guard import judge as judge_hacking
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

    def round(self, tenants: dict) -> bool:
        """Run the reward guard, then the reward-hacking guard, over every unpaused tenant
        (registry tenants by id), at most every `reward_guard_interval_s`. Returns whether
        either acted (rolled a tenant back, paused one): the caller's views are then stale."""
        now = time.monotonic()
        if now - self._guarded_at < self.s.reward_guard_interval_s:
            return False
        self._guarded_at = now
        acted = False
        for t in tenants.values():
            if not t.policy.paused:
                verdict = self.guard(t)
                if verdict is not None and verdict.rollback:
                    acted = True
                    continue
                hacked = self.guard_hacking(t)
                acted |= hacked is not None and hacked.trip
        return acted

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
                target = self._restore(tenant.id, verdict.reference)
                self._note(tenant.id, bad=versions[live].version, target=target, verdict=verdict, guard="reward")
                self.metrics.reward_rollbacks.labels(tenant.id).inc()
                log.warning("reward guard rolled %s back from v%d to v%d: %s", tenant.id, live, target,
                            verdict.reason)
            return verdict
        except Exception:  # noqa: BLE001 - the guard protects serving; it must not stop training
            log.exception("reward guard of %s failed", tenant.id)
            return None

    def guard_hacking(self, tenant) -> HackingVerdict | None:
        """Judge `tenant`'s live version on its served replies and rewards (`hacking_guard.judge`);
        when it hacked its reward, roll it back, pause the tenant and raise an alert. Returns the
        verdict (None when the guard is off or nothing is live). A failure here is logged and
        never stops training."""
        p = tenant.policy
        if not p.hacking_guard or (live := self.registry.live_version(tenant.id)) is None:
            return None
        try:
            tallies, signals = self.buffer.version_rewards(tenant.id), self.buffer.served_signals(tenant.id)
            ready = (measured(tallies.get(live), p.reward_guard_min_samples)
                     and signals.get(live) is not None and signals[live].n >= p.hacking_guard_min_replies)
            versions = {v.version: v for v in self.registry.adapter_versions(tenant.id)} if ready else {}
            verdict = judge_hacking(live, {v: meta.parent_version for v, meta in versions.items()}, tallies, signals,
                                    HackingSettings(min_samples=p.reward_guard_min_samples,
                                                    min_replies=p.hacking_guard_min_replies,
                                                    reward_margin=p.reward_guard_margin,
                                                    empty_rise=p.hacking_guard_empty_rise,
                                                    bad_tool_call_rise=p.hacking_guard_bad_tool_call_rise,
                                                    length_factor=p.hacking_guard_length_factor,
                                                    diversity_fraction=p.hacking_guard_diversity_fraction,
                                                    z=self.s.reward_guard_z))
            if verdict.trip and versions[live].rolled_back is not None:
                return dataclasses.replace(verdict, trip=False, reason=(
                    f"v{live} was made live again after a guard rolled it back; left as it is"))
            if verdict.trip:
                self._stop_hacking(tenant.id, live, verdict)
            return verdict
        except Exception:  # noqa: BLE001 - as in `guard`
            log.exception("reward-hacking guard of %s failed", tenant.id)
            return None

    def _stop_hacking(self, tenant: str, bad: int, verdict: HackingVerdict) -> None:
        """Roll back first (what protects serving), then pause, note, alert and count. A crash
        after the rollback but before the pause leaves the tenant training on from the restored
        weights, unpaused: a reward that keeps paying for degenerate replies trips the guard
        again on a later version."""
        target = self._restore(tenant, verdict.reference)
        what = f"v{bad} was rolled back to v{target}: {verdict.reason}"
        self.registry.update_policy(tenant, paused=True, paused_reason=f"reward hacking: {what}")
        self._note(tenant, bad=bad, target=target, verdict=verdict, guard="reward_hacking")
        self.registry.record_alert(tenant, TenantAlert(kind="reward_hacking", detail=what, version=bad,
                                                       rolled_back_to=target, facts=verdict.summary()))
        self.metrics.reward_hacking.labels(tenant).inc()
        log.error("reward-hacking guard paused %s and rolled it back from v%d to v%d: %s", tenant, bad, target,
                  verdict.reason)

    def _restore(self, tenant: str, reference: int) -> int:
        """Restore `reference`'s weights (checkpointed), then make it live; returns the version
        now live. A crash between the two leaves the bad version live with the weights restored:
        the guard trips again (restoring is idempotent)."""
        weights = self.publisher.weights(tenant, reference)   # unreadable: raises, nothing changed
        self.lifecycle.restore_weights(tenant, weights, reference)
        return self.publisher.rollback(tenant, reference).version

    def _note(self, tenant: str, *, bad: int, target: int, verdict: GuardVerdict | HackingVerdict,
              guard: str) -> None:
        """Note the rollback on the bad version's record and in the tenant's history (a crash
        before it loses only the note)."""
        self.registry.mark_rolled_back(tenant, bad, {"time": time.time(), "to": target, "guard": guard,
                                                     **verdict.summary()})
        # own keys: "reward" is a step's batch reward (the console's reward chart) and "version" a
        # publish (the experiment bench waits for one)
        append_history(self.registry, tenant, {"step": self.store.peek(tenant).step, "rolled_back": bad,
                                               "live": target, "guard": guard,
                                               "served_reward": verdict.live_reward.mean,
                                               "reference_served_reward": verdict.reference_reward.mean})

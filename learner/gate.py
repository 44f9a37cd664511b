"""The publish gate: whether a tenant's candidate adapter may replace its live version, and
the publish that follows when it may (`PublishGate.evaluate_and_publish`).

Held-out examples come from the replay buffer (`ReplayBuffer.heldout`: a stable hash of the
example id keeps them out of training). The candidate's held-out loss is compared with the
live version's on the same examples (`decide`): publish unless the candidate is worse than
live by more than `tolerance` (relative) and by more than `min_margin` (absolute). The
absolute floor matters once both losses are near 0: a candidate at 0.0098 nats per token is
not a regression from a live 0.0032, however many percent apart they are.

The live version's losses are cached per held-out example (`LiveLosses`, on the tenant's
`LearnerTenant` record). The live version is usually the last candidate that passed, scored
when it was gated; when the held-out set grows (new traffic), only the new examples are
scored under the live version, not all of them again.

A candidate that passes is then scored by the forgetting guard (`clora.learner.drift`), when
the tenant's `drift_tolerance` is set: its KL divergence from the base on a shipped set of
general-purpose prompts. One beyond the tolerance is refused too; the refusal is counted
(`clora_learner_publishes{outcome="drift"}`) and noted in the tenant's history, where the
console shows it. Only candidates that passed the held-out gate pay for it. A tenant the
reward-hacking guard paused publishes nothing (`outcome="paused"`), not even from a step that
began before the pause.

A published version is checkpointed with the tenant (a resumed learner never re-trains what a
version already holds), and old versions are pruned (`LearnerSettings.keep_versions`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

from clora.registry import AdapterVersion
from clora.learner.drift import DriftDecision, DriftProbe, decide_drift
from clora.learner.lifecycle import TenantLifecycle
from clora.learner.metrics import LearnerMetrics, append_history
from clora.learner.peft_io import AdapterFormatError
from clora.learner.publish import PublishedWeights, Publisher
from clora.learner.sampling import BufferLike
from clora.learner.settings import LearnerSettings
from clora.learner.tenant import LearnerTenant
from clora.learner.trainer import EXAMPLE_KINDS, Example, Trainer, TrainingPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateDecision:
    """Example: candidate 0.52, live 0.50, tolerance 0.05 -> publish (0.52 <= 0.50 * 1.05)."""

    publish: bool
    candidate_loss: float
    live_loss: float | None
    tolerance: float
    reason: str


def decide(candidate_loss: float, live_loss: float | None, tolerance: float, min_margin: float = 0.0) -> GateDecision:
    if candidate_loss != candidate_loss:  # NaN
        return GateDecision(False, candidate_loss, live_loss, tolerance, "candidate eval loss is NaN")
    if live_loss is None:
        return GateDecision(True, candidate_loss, None, tolerance, "no live version yet")
    margin = max(tolerance * abs(live_loss), min_margin)
    allowed = f"{tolerance:.0%}" if margin > min_margin else f"{min_margin:g}"
    if candidate_loss <= live_loss + margin:
        return GateDecision(True, candidate_loss, live_loss, tolerance,
                            f"candidate {candidate_loss:.4f} <= live {live_loss:.4f} + {allowed}")
    return GateDecision(False, candidate_loss, live_loss, tolerance,
                        f"candidate {candidate_loss:.4f} worse than live {live_loss:.4f} beyond {allowed}")


@dataclass(frozen=True)
class Refusal:
    """Why a candidate is not published: `outcome` labels `clora_learner_publishes`. Example:
    `Refusal("drift", "drift 4.210 nats/token from the base on 16 general prompts exceeds the
    tenant's tolerance 3.000")`."""

    outcome: Literal["rejected", "paused", "drift"]
    reason: str


@dataclass(frozen=True)
class ScoredUnder:
    """What a cached per-example loss depends on besides the example: the weights (a version)
    and the loss. Example: `ScoredUnder(version=3, algorithm="dpo", dpo_beta=0.1)`."""

    version: int
    algorithm: str
    dpo_beta: float

    @staticmethod
    def of(version: int, how: TrainingPolicy) -> ScoredUnder:
        return ScoredUnder(version, how.algorithm, how.dpo_beta)


@dataclass(frozen=True)
class LiveLosses:
    """A version's loss on each held-out example scored so far. Example:
    `LiveLosses(ScoredUnder(3, "sft", 0.1), {"acme-12": 0.41, "acme-30": 0.38})`."""

    scored_under: ScoredUnder
    losses: dict[str, float]
    """Per example id."""


class PublishGate:
    def __init__(self, settings: LearnerSettings, trainer: Trainer, buffer: BufferLike, publisher: Publisher,
                 lifecycle: TenantLifecycle, metrics: LearnerMetrics, tenants: MutableMapping[str, LearnerTenant],
                 registry):
        self.s = settings
        self.trainer = trainer
        self.buffer = buffer
        self.publisher = publisher
        self.lifecycle = lifecycle
        self.store = lifecycle.store
        self.metrics = metrics
        self.tenants = tenants
        self.registry = registry
        self.drift = DriftProbe(trainer, settings.drift_max_prompts)

    def evaluate_and_publish(self, tenant: str, policy: TrainingPolicy) -> AdapterVersion | None:
        """Gate the tenant's current adapter against the live one; publish when it passes.
        Checkpoints first, so a resumed learner never re-trains what a version already holds."""
        self.lifecycle.sync(tenant)
        held: list[Example] = []
        for kind in EXAMPLE_KINDS[policy.algorithm]:  # a mixed step's tenant: the first kind held out
            held = [e for e in self.buffer.heldout(tenant, kind, self.s.eval_max_examples) if e.kind == kind]
            if held:
                break
        scores: dict[str, float] = {}
        try:
            live = self.publisher.live_weights(tenant)
        except AdapterFormatError as e:  # say, its folder was deleted: gate as if nothing were live
            log.error("%s's live version is unreadable (%s: %s); gating its candidate without it", tenant, e,
                      e.__cause__)
            live = None
        if held:
            scored, how = self.trainer.eval_examples(held, policy)
            cand_losses = dict(zip((e.example_id for e in scored), self.trainer.example_losses(tenant, scored, how)))
            cand = statistics.fmean(cand_losses.values())
            live_loss = self.live_loss(tenant, live, scored, how) if live else None
            decision = decide(cand, live_loss, policy.eval_tolerance, self.s.eval_min_margin)
            scores = {"eval_loss": cand, "eval_examples": float(len(held))}
            if live_loss is not None:
                scores["live_eval_loss"] = live_loss
            self.metrics.eval_loss.labels(tenant).set(cand)
        else:  # nothing to compare on yet: publish, and say so
            decision = GateDecision(True, float("nan"), None, policy.eval_tolerance, "no held-out examples")
        refusal = self._refusal(tenant, decision, scores)
        st = self.store.state(tenant)
        self.lifecycle.checkpoint(tenant)
        if refusal is not None:
            log.info("not publishing %s step %d: %s", tenant, st.step, refusal.reason)
            self.metrics.publishes.labels(tenant, refusal.outcome).inc()
            if refusal.outcome == "drift":   # the console shows why (`refused`: not a step, not a publish)
                append_history(self.registry, tenant, {"step": st.step, "refused": refusal.reason,
                                                       "drift": scores["drift"]})
            return None
        version = self.publisher.publish(tenant, st.master.clone(), step=st.step, examples_seen=st.examples_seen,
                                         eval_scores=scores, parent_version=live.version if live else None,
                                         feedback_window=st.feedback_window, lineage=st.lineage)
        st.last_published_version = version.version
        if held:  # the candidate, now live, was scored on these examples
            self.tenants[tenant].live_losses = LiveLosses(ScoredUnder.of(version.version, how), cand_losses)
        st.feedback_window = st.lineage = None          # the next version's window and lineage start here
        append_history(self.registry, tenant, {"step": st.step, "eval": scores.get("eval_loss"),
                                               "version": version.version})
        self.lifecycle.checkpoint(tenant)
        self.metrics.publishes.labels(tenant, "published").inc()
        log.info("published %s v%d (%s)", tenant, version.version, decision.reason)
        self._prune(tenant)
        return version

    def _refusal(self, tenant: str, decision: GateDecision, scores: dict[str, float]) -> Refusal | None:
        """Why the candidate is not published, or None: the held-out decision, then a guard's
        pause (a step that began before the reward-hacking guard paused the tenant), then the
        forgetting guard, measured only when nothing else refused."""
        if not decision.publish:
            return Refusal("rejected", decision.reason)
        policy = self.registry.get_tenant(tenant).policy
        if policy.paused_reason is not None:
            return Refusal("paused", f"a guard paused the tenant: {policy.paused_reason}")
        drift = self._drift(tenant, policy.drift_tolerance, scores)
        return Refusal("drift", drift.reason) if drift is not None and not drift.publish else None

    def _drift(self, tenant: str, tolerance: float | None, scores: dict[str, float]) -> DriftDecision | None:
        """The forgetting guard's decision on `tenant`'s candidate (its drift goes into `scores`);
        None when the tenant's `drift_tolerance` is None."""
        if tolerance is None:
            return None
        reading = self.drift.measure(tenant)
        scores["drift"] = reading.kl
        self.metrics.drift.labels(tenant).set(reading.kl)
        return decide_drift(reading, tolerance)

    def live_loss(self, tenant: str, live: PublishedWeights, scored: list[Example], how: TrainingPolicy) -> float:
        """The live version's loss on the `scored` held-out examples (`Trainer.eval_examples`):
        each example's from the cache when this version was scored on it with the same loss
        settings, the others scored now (and cached). A gate that scores nothing counts a
        cache hit; `clora_learner_gate_live_examples_total` counts the examples scored."""
        under = ScoredUnder.of(live.version, how)
        record = self.tenants[tenant]
        cached = record.live_losses
        losses = cached.losses if cached is not None and cached.scored_under == under else {}
        missing = [e for e in scored if e.example_id not in losses]
        if missing:
            losses = {**losses, **dict(zip((e.example_id for e in missing),
                                           self.trainer.example_losses(tenant, missing, how, weights=live.flat)))}
            self.metrics.gate_live_examples.labels(tenant).inc(len(missing))
        else:
            self.metrics.gate_cache_hits.labels(tenant).inc()
        record.live_losses = LiveLosses(under, losses)
        return statistics.fmean(losses[e.example_id] for e in scored)

    def _prune(self, tenant: str) -> None:
        """Delete the tenant's old versions (`Publisher.prune`); a failure is logged, never raised."""
        try:
            if gone := self.publisher.prune(tenant, self.s.keep_versions):
                log.info("deleted %s's versions %s (keeping %d)", tenant, gone, self.s.keep_versions)
        except Exception:  # noqa: BLE001 - retention must never fail a publish; the next one retries
            log.exception("deleting %s's old versions failed", tenant)

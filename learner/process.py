"""The learner process: runs forever over the replay buffers (`clora learner`).

Each tick: read tenants and policies from the registry, ask the scheduler who trains next,
sample that tenant's replay buffer from its cursor, train one step (prefetching the likely
next tenant meanwhile), and every `publish_every` steps evaluate on the tenant's held-out
examples and publish if the gate allows. Tenant state is checkpointed after steps and at
shutdown; on start every checkpoint is restored, so a crash loses at most the steps since
the last checkpoint. Version numbers come from the registry and the adapters folder, never
from the checkpoint, so they never go back.

Every `reward_guard_interval_s`, the reward guard (`clora.learner.reward_guard`) checks each
unpaused tenant's live version's rewards against its newest well-measured ancestor's, whether
or not the tenant has data to train on; a measurable drop rolls the live version back, and the
tenant trains on from the restored version's weights.

A tenant seen without a checkpoint starts from its live version's weights when it has one
(checkpoints lost), else from its `init_adapter` (published first, as its v1), else from a
fresh LoRA init; see `_register`.

With `training_mode="fused"` a tick instead asks the scheduler for up to `fused_max_tenants`
tenants and trains them all in one fused step (`clora.learner.fused`); a fused tenant is
written back to the store before it is evaluated, published or checkpointed.

Run: `main(LearnerSettings(), kafka_bootstrap="host:9092", redis_url="redis://host:6379/0")`
until SIGTERM/SIGINT. Tests build a `Learner` directly with fakes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
import threading
import time
from typing import Callable, Protocol

import torch

from clora.ingest.schemas import AdapterEvent
from clora.learner.adapter_store import EXP_AVG, GRAD, MASTER, AdapterCapacityError, AdapterStore
from clora.learner.batches import ChatEncoder
from clora.learner.checkpoint import list_checkpoints, load_checkpoint, remove_partial, save_checkpoint
from clora.learner.evaluate import GateDecision, gate
from clora.learner.fused import FusedTrainer, TenantWork
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.losses import has_reward_spread
from clora.learner.metrics import LearnerMetrics
from clora.learner.peft_io import AdapterFormatError
from clora.learner.publish import Publisher
from clora.learner.reward_guard import GuardSettings, GuardVerdict, judge, measured
from clora.learner.scheduler import Scheduler, TenantView
from clora.learner.settings import LearnerSettings
from clora.learner.trainer import EXAMPLE_KIND, Trainer, TrainerConfig, TrainingPolicy

log = logging.getLogger(__name__)


class BufferLike(Protocol):
    def sample(self, tenant: str, kind: str, n: int, *, cursor: int = 0, fresh_fraction: float = 0.5,
               seed: int | None = None, fill: bool = True): ...
    def newer_than(self, tenant: str, kind: str, cursor: int) -> int: ...
    def heldout(self, tenant: str, kind: str, n: int | None = None) -> list: ...
    def version_rewards(self, tenant: str) -> dict: ...


def tenant_seed(tenant: str) -> int:
    """A tenant's own seed, stable across restarts and learners."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=4).digest(), "big")


class Learner:
    def __init__(self, settings: LearnerSettings, model, tokenizer, *, registry, buffer: BufferLike,
                 announce: Callable[[AdapterEvent], None], base_model_name: str,
                 metrics: LearnerMetrics | None = None, device: str = "cpu"):
        self.s = settings
        self.registry = registry
        self.buffer = buffer
        self.metrics = metrics or LearnerMetrics()
        spec = LoraSpec(rank=settings.rank, alpha=settings.alpha, target_modules=settings.target_modules)
        self.model = LoraModel(model, spec)
        self.store = AdapterStore(self.model, device=device, prefetch=settings.prefetch,
                                  compute_dtype=getattr(torch, settings.compute_dtype),
                                  max_tenants=settings.max_tenants, max_host_bytes=settings.max_host_bytes)
        self.trainer = Trainer(self.model, ChatEncoder(tokenizer, settings.max_seq_len), self.store,
                               TrainerConfig(micro_batch_size=settings.micro_batch_size, max_seq_len=settings.max_seq_len))
        self.fused = (FusedTrainer(self.trainer, settings.fused_max_tenants, settings.fused_backend,
                                   max_chunk_tokens=settings.fused_max_chunk_tokens,
                                   max_padding=settings.fused_max_padding)
                      if settings.training_mode == "fused" else None)
        self.publisher = Publisher(settings.adapters_dir, registry, announce, base_model_name, self.model.layout)
        self.scheduler = Scheduler(max_wait_s=settings.max_wait_s, metrics=self.metrics)
        self._rejected: set[str] = set()
        self._dirty: set[str] = set()
        self._flat_checked: dict[str, tuple[int, int, int]] = {}
        """Per tenant, the (cursor, waiting, batch size) its batch was last checked for a reward spread at."""
        self._guarded_at = -float("inf")
        self._failures: dict[str, tuple[int, float]] = {}
        """Per tenant whose last step failed: (failures in a row, monotonic time of the next try)."""
        self._gate_cache: dict[str, tuple[tuple, dict[str, float]]] = {}
        """Per tenant: (live version, policy's loss settings) and that version's loss on each
        held-out example scored so far (by example id). The live version is usually the last
        candidate that passed, measured then; when the held-out set grows (new traffic), only
        the new examples are measured under the live version, not all of them again."""
        self.restore()

    # --- state ----------------------------------------------------------------------------

    def restore(self) -> list[str]:
        """Load every tenant checkpoint; drop torn temporary checkpoint files and publish folders."""
        if partial := remove_partial(self.s.checkpoints_dir):
            log.warning("removed %d checkpoint file(s) a crash left half-written: %s", len(partial),
                        [p.name for p in partial])
        restored = []
        for path in list_checkpoints(self.s.checkpoints_dir):
            st = load_checkpoint(path, self.model.layout.numel)
            self.store.put(st)
            self.publisher.clean_partial(st.tenant)
            restored.append(st.tenant)
        if restored:
            log.info("restored %d tenant checkpoints: %s", len(restored), restored)
        return restored

    def _sync(self, tenant: str) -> None:
        """In fused mode: write the tenant's fused copy back, so the store holds its newest state."""
        if self.fused is not None and self.fused.slots.slot_of(tenant) is not None:
            self.fused.flush([tenant])

    def checkpoint(self, tenant: str) -> None:
        self._sync(tenant)
        save_checkpoint(self.s.checkpoints_dir, self.store.state(tenant), self.model.layout.numel)
        self._dirty.discard(tenant)

    def policy(self, tenant) -> TrainingPolicy:
        p = tenant.policy
        return TrainingPolicy(algorithm=p.algorithm, learning_rate=p.learning_rate, batch_size=p.batch_size,
                              dpo_beta=self.s.dpo_beta, rl_clip_eps=self.s.rl_clip_eps,
                              eval_tolerance=getattr(p, "eval_tolerance", 0.02),
                              fresh_fraction=getattr(p, "fresh_fraction", None))

    def _views(self) -> tuple[list[TenantView], dict]:
        views, tenants = [], {}
        for t in self.registry.list_tenants():
            if t.id in self._rejected:
                continue
            if t.id not in self.store and not self._register(t):
                continue
            p = t.policy
            kind = EXAMPLE_KIND[p.algorithm]
            waiting = self.buffer.newer_than(t.id, kind, self.store.peek(t.id).cursor)
            waits = self._failures.get(t.id, (0, 0.0))[1] > time.monotonic()   # a failed step's back-off
            views.append(TenantView(t.id, p.paused or waits, p.weight, p.priority, p.min_new_examples, waiting))
            tenants[t.id] = t
        return views, tenants

    def _register(self, t) -> bool:
        """Register a tenant that has no checkpoint; False (logged, not retried) when it cannot
        train: over capacity, or its `init_adapter` does not fit the base model's LoRA layout."""
        try:
            self.publisher.clean_partial(t.id)
            self.store.register(t.id, tenant_seed(t.id), self._start_weights(t))
        except (AdapterCapacityError, AdapterFormatError) as e:
            cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
            log.error("tenant %s will not train: %s%s", t.id, e, cause)
            self._rejected.add(t.id)
            return False
        return True

    def _start_weights(self, t) -> torch.Tensor | None:
        """The master weights (P,) a tenant without a checkpoint starts from: its live version's,
        else its `init_adapter`'s (published as a version first, so it serves at once), else
        None (a fresh LoRA init). An unreadable live version falls back to a fresh init."""
        live = self.registry.live_version(t.id)
        if live is None and t.init_adapter:
            version, flat = self.publisher.import_adapter(t.id, t.init_adapter)
            log.info("imported %s's initial adapter from %s as v%d", t.id, t.init_adapter, version.version)
            return flat
        if live is None:
            return None
        try:
            _, flat = self.publisher.live_weights(t.id)
        except AdapterFormatError as e:
            log.warning("tenant %s has no checkpoint and its live v%d is unreadable (%s: %s); starting from a "
                        "fresh LoRA init", t.id, live, e, e.__cause__)
            return None
        log.info("tenant %s has no checkpoint: starting from its live version v%d", t.id, live)
        return flat

    # --- the loop -------------------------------------------------------------------------

    def tick(self) -> str | None:
        """One scheduling decision and at most one training step. Returns the tenant trained
        (in fused mode the first of the fused step's tenants; `tick_fused` returns them all)."""
        if self.fused is not None:
            trained = self.tick_fused()
            return trained[0] if trained else None
        views, tenants = self._views()
        self._guard_round(tenants)
        if self._skip_flat(views, tenants):
            views, tenants = self._views()
        decision = self.scheduler.pick(views)
        if decision.tenant is None:
            return None
        tid = decision.tenant
        try:
            return self._train_one(tid, self.policy(tenants[tid]), views)
        except Exception as e:  # noqa: BLE001 - one tenant's failure must not stop every tenant's training
            self._failed([tid], e)
            return None

    def _train_one(self, tid: str, policy: TrainingPolicy, views: list[TenantView]) -> str | None:
        self._follow_live(tid)
        batch, examples = self._sample(tid, policy)
        if not examples:
            self.scheduler.record(tid, 0.0)
            return None
        if self._flat(tid, policy, batch, examples):
            return None
        result = self.trainer.train_step(tid, examples, policy, prefetch=self.scheduler.peek_next(views, after=tid))
        self.metrics.swap_exposed.inc(max(0.0, self.store.stats.exposed_s - getattr(self, "_exposed_seen", 0.0)))
        self._exposed_seen = self.store.stats.exposed_s
        self._after_step(tid, policy, batch, examples, result)
        self._failures.pop(tid, None)
        return tid

    def _failed(self, tenants: list[str], error: BaseException) -> None:
        """A tenant's step failed (a non-finite gradient, a full disk, an unreadable folder...):
        logged and counted, and the tenant waits before its next try, longer each time in a
        row (5 s doubling to 5 min), while every other tenant trains on. Its batch is not
        skipped: once the cause is fixed it trains on that data."""
        for tid in tenants:
            n = self._failures.get(tid, (0, 0.0))[0] + 1
            wait = min(300.0, 5.0 * 2 ** (n - 1))
            self._failures[tid] = (n, time.monotonic() + wait)
            self.metrics.failures.labels(tid).inc()
            try:
                self._drop_grads(tid)
            except Exception:  # noqa: BLE001 - the state itself may be what failed
                log.exception("clearing %s's gradients after its failed step failed", tid)
            log.error("training %s failed (%d time(s) in a row; next try in %.0f s): %s", tid, n, wait, error,
                      exc_info=error)
            self._history(tid, {"failed": f"{type(error).__name__}: {error}"[:500], "failures": n,   # the console
                                "retry_in_s": wait})                                            # shows it

    def _drop_grads(self, tenant: str) -> None:
        """Forget what a failed step had accumulated, so that its next step starts clean."""
        if tenant not in self.store:
            return
        st, buffer = self._state_to_edit(tenant)
        buffer[GRAD].zero_()
        self.store.put(dataclasses.replace(st, buffer=buffer, micro_steps=0))

    def _state_to_edit(self, tenant: str):
        """(the tenant's state, a copy of its buffer): its fused copy is written back and dropped
        first, so that the caller's `store.put` of the edited copy is the only one left."""
        if self.fused is not None and (i := self.fused.slots.slot_of(tenant)) is not None:
            self.fused.slots.evict(i, self.store)
        st = self.store.state(tenant)
        return st, st.buffer.clone()

    def _follow_live(self, tid: str) -> None:
        """Train on from the live version when someone else chose it: an operator's rollback or
        promote (`clora tenant rollback`, the console) changes only the registry; without this
        the next publish would put the abandoned weights' descendant live again."""
        st = self.store.peek(tid)
        ours = st.extras.get("last_published_version")
        live = self.registry.live_version(tid)
        if live is None or ours is None or live == ours:
            return
        try:
            self._restore_weights(tid, self.publisher.weights(tid, live), live)
            log.warning("%s's live version is v%d, not v%d it last published: training on from v%d", tid, live,
                        ours, live)
        except AdapterFormatError as e:
            st.extras["last_published_version"] = live  # not asked again: trains on from its own weights
            log.error("%s's live v%d is unreadable (%s); training on from its own weights", tid, live, e)

    def tick_fused(self) -> tuple[str, ...]:
        """Fused mode: up to `fused_max_tenants` tenants, one fused step. Returns those trained."""
        if self.fused is None:
            raise RuntimeError("tick_fused needs training_mode='fused'")
        views, tenants = self._views()
        self._guard_round(tenants)
        if self._skip_flat(views, tenants):
            views, tenants = self._views()
        decision = self.scheduler.pick_group(views, self.fused.max_tenants)
        work, sampled = [], {}
        for tid in decision.tenants:
            try:
                self._follow_live(tid)
                policy = self.policy(tenants[tid])
                batch, examples = self._sample(tid, policy)
                if not examples:
                    self.scheduler.record(tid, 0.0)
                    continue
                if self._flat(tid, policy, batch, examples):
                    continue
            except Exception as e:  # noqa: BLE001 - as in `tick`
                self._failed([tid], e)
                continue
            work.append(TenantWork(tid, examples, policy))
            sampled[tid] = batch
        if not work:
            return ()
        try:
            fused = self.fused.train_step(work)
        except Exception as e:  # noqa: BLE001 - the fused step's tenants wait; the others train on
            self._failed([w.tenant for w in work], e)
            return ()
        self.metrics.swap_exposed.inc(fused.swap_s)
        results = {r.tenant: r for r in fused.results}
        for w in work:
            try:
                self._after_step(w.tenant, w.policy, sampled[w.tenant], w.examples, results[w.tenant])
                self._failures.pop(w.tenant, None)
            except Exception as e:  # noqa: BLE001 - as in `tick`
                self._failed([w.tenant], e)
        return tuple(r.tenant for r in fused.results)

    # --- the reward guard ----------------------------------------------------------------------

    def _guard_round(self, tenants: dict) -> None:
        """Run the reward guard over every unpaused tenant, at most every `reward_guard_interval_s`."""
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
        self._restore_weights(tenant, self.publisher.weights(tenant, verdict.reference),  # unreadable: raises
                              verdict.reference)
        target = self.publisher.rollback(tenant, verdict.reference)
        self.registry.mark_rolled_back(tenant, bad.version,
                                       {"time": time.time(), "to": verdict.reference, **verdict.summary()})
        self.metrics.reward_rollbacks.labels(tenant).inc()
        # own keys: "reward" is a step's batch reward (the console's reward chart) and "version" a
        # publish (the experiment bench waits for one)
        self._history(tenant, {"step": self.store.peek(tenant).step, "rolled_back": bad.version,
                               "live": target.version, "served_reward": verdict.live_reward.mean,
                               "reference_served_reward": verdict.reference_reward.mean})
        log.warning("reward guard rolled %s back from v%d to v%d: %s", tenant, bad.version, target.version,
                    verdict.reason)

    def _restore_weights(self, tenant: str, flat: torch.Tensor, version: int) -> None:
        """Train on from `flat` (a published version's weights): the master weights are replaced
        and Adam's momentum is cleared (it points along the abandoned trajectory); the second
        moments and the step count stay, so the per-parameter scale stays calibrated and the
        first updates ramp up as momentum rebuilds. Steps, examples seen and the cursor stay:
        the data consumed since is not trained on again. Checkpointed at once."""
        st, buffer = self._state_to_edit(tenant)
        buffer[MASTER].copy_(flat)
        buffer[EXP_AVG].zero_()
        buffer[GRAD].zero_()
        extras = {k: v for k, v in st.extras.items() if k != "feedback_window"}   # its data is not in these weights
        extras["last_published_version"] = version                                # the weights it trains on from
        self.store.put(dataclasses.replace(st, buffer=buffer, micro_steps=0, extras=extras))
        self.checkpoint(tenant)

    def _on_policy(self, policy: TrainingPolicy) -> bool:
        return policy.algorithm == "rl" and self.s.rl_on_policy

    def _sample(self, tid: str, policy: TrainingPolicy):
        """(buffer sample, the examples of the policy's kind) for one step of `tid`. On-policy
        RL takes the oldest `batch_size` examples past the cursor: no random draw, so the same
        call gives the same batch until the cursor moves (`_skip_flat` relies on that)."""
        kind = EXAMPLE_KIND[policy.algorithm]
        st = self.store.peek(tid)
        on_policy = self._on_policy(policy)
        seed = None
        if not on_policy:
            gen = st.generator()
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            st.save_generator(gen)
        fresh = 1.0 if on_policy else policy.fresh_fraction if policy.fresh_fraction is not None else self.s.fresh_fraction
        batch = self.buffer.sample(tid, kind, policy.batch_size, cursor=st.cursor, seed=seed,
                                   fresh_fraction=fresh, fill=not on_policy)
        return batch, [e for e in batch.examples if e.kind == kind]

    def _skip_flat(self, views: list[TenantView], tenants: dict) -> bool:
        """Consume every eligible on-policy RL tenant's batch that has no reward spread, before
        the scheduler picks who trains. Such a batch costs a buffer read, not a step, so it
        should not wait in the queue behind other tenants' steps: its tenant's next rollouts
        wait for it (`clora bench experiments` saw such waits of up to 60 s at 8 tenants). A
        batch is checked once per (cursor, waiting, batch size) it was seen at. Returns whether
        any was consumed (the views are then stale)."""
        consumed = False
        for v in views:
            policy = self.policy(tenants[v.id]) if v.eligible else None
            if policy is None or not self._on_policy(policy):
                continue
            seen = (self.store.peek(v.id).cursor, v.waiting, policy.batch_size)
            if self._flat_checked.get(v.id) == seen:
                continue
            self._flat_checked[v.id] = seen
            batch, examples = self._sample(v.id, policy)
            consumed |= bool(examples) and self._flat(v.id, policy, batch, examples)
        return consumed

    def _flat(self, tid: str, policy: TrainingPolicy, batch, examples: list) -> bool:
        """An RL batch in which no group has a reward spread has advantage 0 everywhere: no
        gradient, yet an optimizer step would still move the weights along Adam's old momentum.
        Such a batch is consumed (the cursor moves past it) without a step; returns True then."""
        if policy.algorithm != "rl" or has_reward_spread([e.reward for e in examples], [e.group_id for e in examples]):
            return False
        st = self.store.peek(tid)
        st.cursor = max(st.cursor, batch.cursor)
        self._dirty.add(tid)
        self.scheduler.record(tid, 0.0)
        self.metrics.flat_batches.labels(tid).inc()
        log.info("skipped %s: no group among its %d samples has a reward spread", tid, len(examples))
        return True

    def _after_step(self, tid: str, policy: TrainingPolicy, batch, examples: list, result) -> None:
        """Bookkeeping after a tenant's step: cursor, lineage window, metrics, history, publish/checkpoint."""
        st = self.store.peek(tid)
        st.cursor = max(st.cursor, batch.cursor)
        _widen_window(st.extras, [e.time for e in examples])
        self._dirty.add(tid)
        self.scheduler.record(tid, result.seconds)
        m = self.metrics
        m.steps.labels(tid, policy.algorithm).inc()
        m.tokens.labels(tid).inc(result.tokens)
        m.loss.labels(tid).set(result.loss)
        packed = f" in {result.rows} rows" if result.rows is not None and result.rows < result.examples else ""
        log.info("trained %s step %d: loss %.4f, %d examples%s, %d tokens, %.2fs", tid, result.step, result.loss,
                 result.examples, packed, result.tokens, result.seconds)
        rewards = [e.reward for e in examples if e.kind == "rl"]
        self._history(tid, {"step": result.step, "loss": result.loss, "examples": result.examples,
                            "seconds": result.seconds, "reward": sum(rewards) / len(rewards) if rewards else None})
        if st.step % self.s.publish_every == 0:
            self.evaluate_and_publish(tid, policy)
        elif st.step % self.s.checkpoint_every == 0:
            self.checkpoint(tid)

    def evaluate_and_publish(self, tenant: str, policy: TrainingPolicy):
        """Gate the tenant's current adapter against the live one; publish when it passes.
        Checkpoints first, so a resumed learner never re-trains what a version already holds."""
        self._sync(tenant)
        kind = EXAMPLE_KIND[policy.algorithm]
        held = [e for e in self.buffer.heldout(tenant, kind, self.s.eval_max_examples) if e.kind == kind]
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
            live_loss = self._live_loss(tenant, live, scored, how) if live else None
            decision = gate(cand, live_loss, policy.eval_tolerance, self.s.eval_min_margin)
            scores = {"eval_loss": cand, "eval_examples": float(len(held))}
            if live_loss is not None:
                scores["live_eval_loss"] = live_loss
            self.metrics.eval_loss.labels(tenant).set(cand)
        else:  # nothing to compare on yet: publish, and say so
            decision = GateDecision(True, float("nan"), None, policy.eval_tolerance, "no held-out examples")
        st = self.store.state(tenant)
        self.checkpoint(tenant)
        if not decision.publish:
            log.info("not publishing %s step %d: %s", tenant, st.step, decision.reason)
            self.metrics.publishes.labels(tenant, "rejected").inc()
            return None
        window = st.extras.get("feedback_window")
        version = self.publisher.publish(tenant, st.master.clone(), step=st.step, examples_seen=st.examples_seen,
                                         eval_scores=scores, parent_version=live[0] if live else None,
                                         feedback_window=tuple(window) if window else None)
        st.extras["last_published_version"] = version.version
        if held:
            self._gate_cache[tenant] = (_gate_key(version.version, how), cand_losses)
        st.extras.pop("feedback_window", None)            # the next version's window starts here
        self._history(tenant, {"step": st.step, "eval": scores.get("eval_loss"), "version": version.version})
        self.checkpoint(tenant)
        self.metrics.publishes.labels(tenant, "published").inc()
        log.info("published %s v%d (%s)", tenant, version.version, decision.reason)
        try:
            if gone := self.publisher.prune(tenant, self.s.keep_versions):
                log.info("deleted %s's versions %s (keeping %d)", tenant, gone, self.s.keep_versions)
        except Exception:  # noqa: BLE001 - retention must never fail a publish; the next one retries
            log.exception("deleting %s's old versions failed", tenant)
        return version

    def _live_loss(self, tenant: str, live: tuple[int, torch.Tensor], scored: list, how: TrainingPolicy) -> float:
        """The live version's loss on the `scored` held-out examples (`Trainer.eval_examples`):
        each example's from the cache when this version was measured on it with the same loss
        settings, the others measured now (and cached). A gate that measures nothing counts a
        cache hit; `clora_learner_gate_live_examples_total` counts the examples measured."""
        key = _gate_key(live[0], how)
        cached_key, losses = self._gate_cache.get(tenant, (None, {}))
        losses = losses if cached_key == key else {}
        missing = [e for e in scored if e.example_id not in losses]
        if missing:
            losses = {**losses, **dict(zip((e.example_id for e in missing),
                                           self.trainer.example_losses(tenant, missing, how, weights=live[1])))}
            self.metrics.gate_live_examples.labels(tenant).inc(len(missing))
        else:
            self.metrics.gate_cache_hits.labels(tenant).inc()
        self._gate_cache[tenant] = (key, losses)
        return statistics.fmean(losses[e.example_id] for e in scored)

    def _history(self, tenant: str, point: dict) -> None:
        """Append to the tenant's metrics history (the console plots it). Never fails a step."""
        append = getattr(self.registry, "append_metrics", None)
        if append is None:
            return
        try:
            append(tenant, point)
        except Exception:  # noqa: BLE001 - a console metric must not stop training; logged
            log.exception("could not record metrics for %s", tenant)

    def run_forever(self, stop: threading.Event) -> None:
        """Tick until `stop` is set; then checkpoint every tenant trained since its last checkpoint."""
        try:
            while not stop.is_set():
                if self.tick() is None:
                    stop.wait(self.s.idle_sleep_s)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self.fused is not None:
            self.fused.flush()
        self.store.flush()
        for tenant in sorted(self._dirty):
            self.checkpoint(tenant)
        self.store.close()
        log.info("learner stopped")


def _gate_key(version: int, how: TrainingPolicy) -> tuple:
    """What a cached per-example loss depends on besides the example: the weights and the loss."""
    return version, how.algorithm, how.dpo_beta


def _widen_window(extras: dict, times: list[float]) -> None:
    """Track (first, last) feedback time of the examples trained since the last publish."""
    if not times:
        return
    lo, hi = extras.get("feedback_window", (min(times), max(times)))
    extras["feedback_window"] = [min(lo, *times), max(hi, *times)]


def main(settings: LearnerSettings, kafka_bootstrap: str, redis_url: str) -> None:
    """Entry point of `clora learner`: run until SIGTERM/SIGINT."""
    import signal

    import redis

    from clora.registry import Registry
    from clora.ingest.buffers import ReplayBuffer
    from clora.ingest.producer import EventProducer
    from clora.ingest.schemas import TOPIC_ADAPTERS
    from clora.learner.base_model import DEFAULT_SOURCE, SMOLLM2_NAME, load_base_model, prepare_base_model

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if settings.metrics_port:
        from prometheus_client import REGISTRY, start_http_server

        start_http_server(settings.metrics_port, addr="127.0.0.1")
        metrics = LearnerMetrics(REGISTRY)
    else:
        metrics = LearnerMetrics()
    path = prepare_base_model(settings.base_model, settings.models_dir)
    model, tok = load_base_model(path, dtype=getattr(torch, settings.compute_dtype), device=device)
    client = redis.Redis.from_url(redis_url)
    producer = EventProducer(kafka_bootstrap)

    def announce(event: AdapterEvent) -> None:
        producer.send_sync(TOPIC_ADAPTERS, event.tenant, event.model_dump_json())

    learner = Learner(settings, model, tok, registry=Registry(client), buffer=ReplayBuffer(client), announce=announce,
                      base_model_name=SMOLLM2_NAME if settings.base_model == DEFAULT_SOURCE else str(path), metrics=metrics, device=device)
    learner.run_forever(stop)

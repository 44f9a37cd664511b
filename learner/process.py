"""The learner process: `Learner`, the loop that runs forever over the replay buffers, and
`main`, the entry point of `clora learner`.

Each tick: read tenants and policies from the registry (registering new ones), run the reward
guard's round when it is due, consume flat RL batches, ask the scheduler who trains next,
sample that tenant's replay buffer from its cursor, train one step (prefetching the likely
next tenant meanwhile), and every `publish_every` steps gate and maybe publish the tenant's
adapter; checkpoint after steps and at shutdown. With `training_mode="fused"` a tick instead
asks the scheduler for up to `fused_max_tenants` tenants and trains them all in one fused
step (`clora.learner.fused`); a fused tenant is written back to the store before it is
evaluated, published or checkpointed.

Several learners share the tenants (`leases`): each tick first renews this learner's leases,
takes free ones up to its fair share and hands back those beyond it; a tenant trains only on
the learner that holds its lease, which is checked again before each step and (through every
checkpoint and registry write: `clora.fencing`) before each publish. A tenant whose lease is lost
is dropped from memory at once, unsaved (`FencedOut` anywhere in its work means the same); its
new holder resumes from the newest checkpoint.

The invariant that makes a takeover lose nothing and train nothing twice: a version is
published only after a checkpoint of exactly its weights, with the cursor past every example
those weights trained on, was written under the publisher's lease (`gate`: checkpoint, then
publish, then checkpoint again with the version recorded). A successor resumes from the newest
checkpoint of the newest lease, so every published version's examples are behind the cursor it
resumes from (never trained again as new), and every example past that cursor was trained only
into weights that died with the old holder, unpublished (it is trained again, once, into the
weights that live on). A version published after that checkpoint, whose own checkpoint the old
holder did not live to write, is recognised as the state's own and adopted
(`TenantLifecycle.follow_live`).

The loop composes the parts, each in its own module: `lifecycle` (register, load, drop,
checkpoint, follow the live version), `leases` (who trains which tenant), `ownership` (acting on
leases gained, lost and handed back), `sampling` (batches, flat RL batches), `backoff` (failed
steps), `gate` (evaluate and publish), `rollback` (the reward guard), and `tenant` (the
loop's record of each tenant).

Run: `main(LearnerSettings(), kafka_bootstrap="host:9092", redis_url="redis://host:6379/0")`
until SIGTERM/SIGINT. Tests build a `Learner` directly with fakes (without `leases`, it is the
sole learner and holds every tenant).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable

import torch

from clora.checkpoint_storage import CheckpointStorage, LocalCheckpoints, open_checkpoint_storage
from clora.fencing import FencedOut
from clora.freshness import VersionLineage
from clora.ingest.schemas import AdapterEvent
from clora.procs import Heartbeat
from clora.registry import TenantNotFound
from clora.storage import AdapterStorage, StorageSettings, open_storage
from clora.learner.adapter_store import AdapterStore
from clora.learner.backoff import StepFailures
from clora.learner.batches import ChatEncoder
from clora.learner.checkpoint import Checkpoints
from clora.learner.external import ExternalWork, metric_label, owner
from clora.learner.fused import FusedTrainer, TenantWork
from clora.learner.gate import PublishGate
from clora.learner.leases import Leases, RedisLeases, SoleLearner
from clora.learner.lifecycle import TenantLifecycle
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.metrics import LearnerMetrics, append_history
from clora.learner.ownership import Ownership
from clora.learner.publish import CanaryProbe, Publisher
from clora.learner.rollback import RewardRollback
from clora.learner.sampling import BatchSeen, BufferLike, Draw, Sampler
from clora.learner.scheduler import Scheduler, TenantView
from clora.learner.settings import LearnerSettings
from clora.learner.tenant import LearnerTenant
from clora.learner.trainer import EXAMPLE_KINDS, MIXED, StepResult, Trainer, TrainerConfig, TrainingPolicy

log = logging.getLogger(__name__)

__all__ = ["BufferLike", "Learner", "main"]

MIXED_POLICY_FIELDS = {"unpaired", "kto_beta", "kto_desirable_weight", "kto_undesirable_weight", "desirable_reward",
                       "reward_baseline_momentum", "sft_weight", "dpo_weight", "pg_weight", "kto_weight"}
"""The registry policy's fields the mixed steps (`auto`, `kto`) read, passed on as they are."""


class Learner:
    def __init__(self, settings: LearnerSettings, model, tokenizer, *, registry, buffer: BufferLike,
                 announce: Callable[[AdapterEvent], None], base_model_name: str,
                 metrics: LearnerMetrics | None = None, device: str = "cpu", storage: AdapterStorage | None = None,
                 leases: Leases | None = None, checkpoints: CheckpointStorage | None = None):
        """`leases`: how the tenants are shared with other learners (None: this one holds them
        all). `checkpoints`: where checkpoints live (None: `settings.checkpoints_dir`)."""
        self.s = settings
        self.leases: Leases = leases if leases is not None else SoleLearner()
        self.registry = registry
        self.buffer = buffer
        self.metrics = metrics or LearnerMetrics()
        spec = LoraSpec(rank=settings.rank, alpha=settings.alpha, target_modules=settings.target_modules)
        if isinstance(model, LoraModel) or hasattr(model, "reduce_grads"):   # wrapped already (megatron)
            if model.spec != spec:
                raise ValueError(f"the model's LoRA spec {model.spec} is not the settings' {spec}")
            self.model = model
        else:
            self.model = LoraModel(model, spec)
        self.store = AdapterStore(self.model, device=device, prefetch=settings.prefetch,
                                  compute_dtype=getattr(torch, settings.compute_dtype),
                                  max_tenants=settings.max_tenants, max_host_bytes=settings.max_host_bytes)
        self.trainer = Trainer(self.model, ChatEncoder(tokenizer, settings.max_seq_len), self.store,
                               TrainerConfig(micro_batch_size=settings.micro_batch_size, max_seq_len=settings.max_seq_len,
                                             autocast=settings.autocast))
        self.fused = (FusedTrainer(self.trainer, settings.fused_max_tenants, settings.fused_backend,
                                   max_chunk_tokens=settings.fused_max_chunk_tokens,
                                   max_padding=settings.fused_max_padding)
                      if settings.training_mode == "fused" else None)
        self.publisher = Publisher(settings.adapters_dir, registry, announce, base_model_name, self.model.layout,
                                   storage=storage, fence=self.leases.check,
                                   canary=CanaryProbe(self.model, tokenizer))
        self.checkpoints = Checkpoints(checkpoints if checkpoints is not None else
                                       LocalCheckpoints(settings.checkpoints_dir), self.model.layout.numel)
        self.scheduler = Scheduler(max_wait_s=settings.max_wait_s, metrics=self.metrics, label=metric_label)
        self.tenants: defaultdict[str, LearnerTenant] = defaultdict(LearnerTenant)
        """The loop's record of each tenant, by id (created on first use)."""
        self.lifecycle = TenantLifecycle(settings, registry, self.store, self.publisher, self.fused, self.tenants,
                                         self.checkpoints, self.leases.check)
        self.ownership = Ownership(self.leases, self.lifecycle, self.tenants, lambda: self.external)
        self.sampler = Sampler(settings, buffer, self.store, self.scheduler, self.metrics, self.tenants)
        self.failures = StepFailures(self.tenants, self.lifecycle, self.metrics, registry)
        self.gate = PublishGate(settings, self.trainer, buffer, self.publisher, self.lifecycle, self.metrics,
                                self.tenants, registry)
        self.rollback = RewardRollback(settings, registry, buffer, self.publisher, self.lifecycle, self.metrics)
        self._exposed_seen = 0.0
        """The store's exposed swap time already counted in `metrics.swap_exposed`."""
        self.external: ExternalWork | None = None
        """Work from outside the buffers the scheduler shares out too (the Tinker API's runs);
        set after construction, since it runs on this learner's model and store."""
        self.lifecycle.restore()

    def policy(self, tenant) -> TrainingPolicy:
        """The training policy of registry tenant `tenant`, with the learner's loss settings."""
        p = tenant.policy
        return TrainingPolicy(**p.model_dump(include=MIXED_POLICY_FIELDS), algorithm=p.algorithm,
                              learning_rate=p.learning_rate, batch_size=p.batch_size,
                              dpo_beta=self.s.dpo_beta, rl_clip_eps=self.s.rl_clip_eps,
                              eval_tolerance=getattr(p, "eval_tolerance", 0.02),
                              fresh_fraction=getattr(p, "fresh_fraction", None))

    # --- the loop -------------------------------------------------------------------------

    def tick(self) -> str | None:
        """One scheduling decision and at most one training step. Returns the tenant trained,
        None when none was or its step failed (in fused mode the first of the fused step's
        tenants; `tick_fused` returns them all)."""
        if self.fused is not None:
            trained = self.tick_fused()
            return trained[0] if trained else None
        views, registered = self._open_tick()
        tid = self.scheduler.pick(views).tenant
        if tid is None:
            return None
        if self.external is not None and self.external.owns(tid):
            return tid if self._run_external(tid) else None
        try:
            draw = self._draw(tid, registered[tid])
        except Exception as e:  # noqa: BLE001 - one tenant's failure must not stop every tenant's training
            self._failed([tid], e)
            return None
        if draw is None:
            return None
        nxt = self.scheduler.peek_next(views, after=tid)
        prefetch = nxt if nxt is not None and nxt in self.store else None
        return tid if self._train_alone(draw, prefetch=prefetch) else None

    def _run_external(self, key: str) -> bool:
        """One unit of external work `key`, charged to it, while its tenant's lease holds;
        whether something ran."""
        try:
            self.leases.check(owner(key))
            seconds = self.external.run(key)
        except FencedOut as e:
            self.ownership.let_go(owner(key), e)
            seconds = None
        except Exception:  # noqa: BLE001 - as a tenant's failure: the others train on
            log.exception("external work %s failed", key)
            seconds = None
        if seconds is None:
            self.scheduler.record(key, 0.0)
            return False
        self.scheduler.record(key, seconds)
        return True

    def _train_alone(self, draw: Draw, prefetch: str | None = None) -> bool:
        """One serial step for `draw`'s tenant (prefetching `prefetch`'s state meanwhile), then its
        bookkeeping. False when either failed (the tenant backs off; the others train on)."""
        if self.fused is not None and (slot := self.fused.slots.slot_of(draw.tenant)) is not None:
            self.fused.slots.evict(slot, self.store)  # its fused copy goes back: the store's is the only one
        try:
            self.leases.check(draw.tenant)
            result = self.trainer.train_step(draw.tenant, draw.examples, draw.policy, prefetch=prefetch)
            self.metrics.swap_exposed.inc(max(0.0, self.store.stats.exposed_s - self._exposed_seen))
            self._exposed_seen = self.store.stats.exposed_s
            self._after_step(draw, result)
        except Exception as e:  # noqa: BLE001 - one tenant's failure must not stop every tenant's training
            self._failed([draw.tenant], e)
            return False
        return True

    def tick_fused(self) -> tuple[str, ...]:
        """Fused mode: up to `fused_max_tenants` tenants, one fused step. Returns those trained
        (a tenant whose bookkeeping after the step failed included). A tenant whose step mixes
        objectives (`auto`, `kto`), which the fused trainer does not run, takes a serial step
        after the fused one."""
        if self.fused is None:
            raise RuntimeError("tick_fused needs training_mode='fused'")
        views, registered = self._open_tick()
        draws = []
        picked = self.scheduler.pick_group(views, self.fused.max_tenants).tenants
        ran = tuple(k for k in picked if self.external is not None and self.external.owns(k) and self._run_external(k))
        for tid in picked:
            if self.external is not None and self.external.owns(tid):
                continue
            try:
                if (draw := self._draw(tid, registered[tid])) is not None:
                    draws.append(draw)
            except Exception as e:  # noqa: BLE001 - as in `tick`
                self._failed([tid], e)
        alone = [d for d in draws if d.policy.algorithm in MIXED]
        draws = [d for d in draws if d.policy.algorithm not in MIXED]
        trained_alone = ran + tuple(d.tenant for d in alone if self._train_alone(d))
        draws = [d for d in draws if self.ownership.check(d.tenant)]
        if not draws:
            return trained_alone
        try:
            step = self.fused.train_step([TenantWork(d.tenant, d.examples, d.policy) for d in draws])
        except Exception as e:  # noqa: BLE001 - the fused step's tenants wait; the others train on
            self._failed([d.tenant for d in draws], e)
            return trained_alone
        self.metrics.swap_exposed.inc(step.swap_s)
        results = {r.tenant: r for r in step.results}
        for draw in draws:
            try:
                self._after_step(draw, results[draw.tenant])
            except Exception as e:  # noqa: BLE001 - as in `tick`
                self._failed([draw.tenant], e)
        return trained_alone + tuple(r.tenant for r in step.results)

    def _failed(self, tenants: list[str], error: BaseException) -> None:
        """The work of `tenants` failed: a lost lease lets each go (`FencedOut`), and so does the
        tenant's deletion (whatever its work then failed on: its version claim, its folder);
        any other error backs them off (`StepFailures`)."""
        if isinstance(error, FencedOut):
            for tid in tenants:
                self.ownership.let_go(tid, error)
            return
        gone = [tid for tid in tenants if self._deleted(tid)]
        for tid in gone:
            log.info("tenant %s was deleted during its work (%s: %s); dropping it", tid, type(error).__name__, error)
            self.ownership.let_go(tid, "the tenant was deleted")
        if rest := [tid for tid in tenants if tid not in gone]:
            self.failures.failed(rest, error)

    def _deleted(self, tenant: str) -> bool:
        """Whether `tenant` is being deleted or gone from the registry (False when the registry
        cannot say: the failure is then treated as the tenant's)."""
        try:
            self.registry.get_tenant(tenant)
        except TenantNotFound:
            return True
        except Exception:  # noqa: BLE001 - Redis away: back off as for any failure
            return False
        return False

    def _admit(self, t) -> bool:
        """`lifecycle.admit(t)`, where a failure (its initial adapter's import, a checkpoint read)
        is the tenant's: it backs off like a failed step, and the loop goes on for the others."""
        if t.id not in self.store and self.tenants[t.id].waits(time.monotonic()):
            return False
        try:
            return self.lifecycle.admit(t)
        except Exception as e:  # noqa: BLE001 - one tenant's admission must not stop the learner
            self._failed([t.id], e)
            return False

    def _open_tick(self) -> tuple[list[TenantView], dict]:
        """What every tick starts with: the lease work, then the tenants' views and registry
        tenants (by id), after the reward guard's round (when due) and the flat RL batches consumed."""
        tenants = self.registry.list_tenants()
        self.ownership.follow([t.id for t in tenants])
        views, registered = self._views(tenants)
        if self.rollback.round(registered):    # a guard paused or rolled back a tenant: it must not train now
            views, registered = self._views()
        if self.sampler.skip_flat(views, {v.id: self.policy(registered[v.id]) for v in views if v.eligible}):
            views, registered = self._views()
        if self.external is not None:
            views += self.external.views(registered)
        return views, registered

    def _views(self, tenants: list | None = None) -> tuple[list[TenantView], dict]:
        """What the scheduler knows about each tenant this learner holds and can train, and those
        registry tenants by id (`tenants`: the registry's, when just read). A tenant backing off
        after a failed step, or whose flat RL batch is held for more of its group
        (`Sampler.flat_cut`), shows as paused."""
        views, registered = [], {}
        for t in tenants if tenants is not None else self.registry.list_tenants():
            if not self.leases.holds(t.id) or not self._admit(t):
                continue
            p = t.policy
            cursor = self.store.peek(t.id).cursor
            waiting = sum(self.buffer.newer_than(t.id, kind, cursor) for kind in EXAMPLE_KINDS[p.algorithm])
            record = self.tenants[t.id]
            paused = (p.paused or record.waits(time.monotonic())
                      or record.flat_held == BatchSeen(cursor, waiting, p.batch_size))
            views.append(TenantView(t.id, paused, p.weight, p.priority, p.min_new_examples, waiting))
            registered[t.id] = t
        return views, registered

    def _draw(self, tid: str, tenant) -> Draw | None:
        """`tid`'s batch for the step it was picked for, after following its live version; None
        (and no step) when it has nothing of its algorithm's kind or a flat RL batch (consumed
        or held: `Sampler.consume_if_flat`)."""
        policy = self.policy(tenant)
        self.lifecycle.follow_live(tid)
        draw = self.sampler.draw(tid, policy)
        if not draw.examples:
            self.scheduler.record(tid, 0.0)
            return None
        if self.sampler.consume_if_flat(draw):
            return None
        return draw

    def _after_step(self, draw: Draw, result: StepResult) -> None:
        """Bookkeeping after a tenant's step: cursor, feedback window and lineage, metrics,
        history, publish or checkpoint; the back-off of an earlier failure ends."""
        tid, policy, examples = draw.tenant, draw.policy, draw.examples
        st = self.store.peek(tid)
        st.cursor = max(st.cursor, draw.batch.cursor)
        st.feedback_window = _widen(st.feedback_window, [e.time for e in examples])
        if fresh := draw.fresh:      # the next version's lineage: the events it trains on first
            st.lineage = (st.lineage or VersionLineage()).extended(
                ((e.feedback_event_id, e.accepted_at) for e in fresh), self.s.lineage_max_events)
        self.tenants[tid].dirty = True
        self.scheduler.record(tid, result.seconds, tokens=result.tokens)
        m = self.metrics
        m.steps.labels(tid, policy.algorithm).inc()
        m.tokens.labels(tid).inc(result.tokens)
        m.loss.labels(tid).set(result.loss)
        packed = f" in {result.rows} rows" if result.rows is not None and result.rows < result.examples else ""
        log.info("trained %s step %d: loss %.4f, %d examples%s, %d tokens, %.2fs", tid, result.step, result.loss,
                 result.examples, packed, result.tokens, result.seconds)
        rewards = [e.reward for e in examples if e.kind == "rl"]
        append_history(self.registry, tid, {"step": result.step, "loss": result.loss, "examples": result.examples,
                                            "seconds": result.seconds,
                                            "reward": sum(rewards) / len(rewards) if rewards else None})
        if st.step % self.s.publish_every == 0:
            self.gate.evaluate_and_publish(tid, policy)
        elif st.step % self.s.checkpoint_every == 0:
            self.lifecycle.checkpoint(tid)
        self.failures.succeeded(tid)

    # --- running ------------------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        """Tick until `stop` is set; then checkpoint every tenant trained since its last checkpoint.
        Each pass beats the heartbeat `clora up` watches (`CLORA_HEARTBEAT_FILE`)."""
        heartbeat = Heartbeat.from_env()
        keepalive = getattr(self.model, "keepalive", None)   # the megatron backend's other ranks wait on it
        if isinstance(self.leases, RedisLeases):   # a step longer than the lease's TTL keeps its lease
            self.leases.keep_alive(lambda s: time.monotonic() - heartbeat.last < s, self.s.lease_keepalive_s, stop)
        try:
            while not stop.is_set():
                heartbeat.beat()
                if keepalive is not None:
                    keepalive()
                if self.tick() is None:
                    if self.external is not None:
                        self.external.wait(self.s.idle_sleep_s)   # new external work wakes it at once
                    else:
                        stop.wait(self.s.idle_sleep_s)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Checkpoint every tenant trained since its last checkpoint (those whose lease is still
        ours), then release the leases, so other learners take the tenants at their next tick."""
        if self.fused is not None:
            self.fused.flush()
        self.store.flush()
        for tenant in sorted(t for t, record in self.tenants.items() if record.dirty and t in self.store):
            try:
                self.lifecycle.checkpoint(tenant)
            except FencedOut as e:
                log.warning("not checkpointing %s at shutdown: %s", tenant, e)
        if self.external is not None:
            self.external.close()
        self.leases.close()
        self.store.close()
        log.info("learner stopped")


def _widen(window: tuple[float, float] | None, times: list[float]) -> tuple[float, float] | None:
    """`window`, the (first, last) feedback time trained on since the last publish, widened to
    cover `times`."""
    if not times:
        return window
    lo, hi = window or (min(times), max(times))
    return min(lo, *times), max(hi, *times)


def main(settings: LearnerSettings, kafka_bootstrap: str, redis_url: str,
         external: Callable[[Learner, object], ExternalWork] | None = None) -> None:
    """Entry point of `clora learner`: run until SIGTERM/SIGINT. `external(learner, redis)` builds
    the work from outside the buffers it also schedules (`clora.trainapi.executor.make_tinker_work`)."""
    import signal

    import redis

    from clora.registry import Registry
    from clora.ingest.buffers import ReplayBuffer
    from clora.ingest.producer import EventProducer
    from clora.ingest.schemas import TOPIC_ADAPTERS
    from clora.learner.base_model import base_model_name, load_base_model, prepare_base_model

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    path = prepare_base_model(settings.base_model, settings.models_dir)
    dtype = getattr(torch, settings.compute_dtype)
    if settings.backend == "megatron":
        from transformers import AutoTokenizer

        from clora.learner import megatron_tp

        megatron_tp.die_with_launcher()
        megatron_tp.init_parallel(settings.tensor_parallel, dp=settings.data_parallel,
                                  timeout_s=settings.parallel_timeout_s)
        spec = LoraSpec(rank=settings.rank, alpha=settings.alpha, target_modules=settings.target_modules)
        model = megatron_tp.MegatronLoraModel(path, spec, dtype=dtype)
        model.exit_on_failure = True   # a broken group restarts the learner from its checkpoints
        if model.rank != 0:
            for sig in (signal.SIGTERM, signal.SIGINT):   # rank 0 says when to stop, after its checkpoints
                signal.signal(sig, signal.SIG_IGN)
            model.follow()
            megatron_tp.shutdown_parallel()
            return
        tok = AutoTokenizer.from_pretrained(str(path))
        log.info("megatron backend: the base split over %d ranks, %d data-parallel replicas",
                 settings.tensor_parallel, settings.data_parallel)
    else:
        model, tok = load_base_model(path, dtype=dtype, device=device)
    if settings.metrics_port:
        from prometheus_client import REGISTRY, start_http_server

        start_http_server(settings.metrics_port, addr=settings.metrics_host)
        metrics = LearnerMetrics(REGISTRY)
    else:
        metrics = LearnerMetrics()
    client = redis.Redis.from_url(redis_url)
    producer = EventProducer(kafka_bootstrap)
    storage = StorageSettings()

    def announce(event: AdapterEvent) -> None:
        producer.send_sync(TOPIC_ADAPTERS, event.tenant, event.model_dump_json())

    learner = Learner(settings, model, tok, registry=Registry(client), buffer=ReplayBuffer(client), announce=announce,
                      base_model_name=base_model_name(settings.base_model, path), metrics=metrics, device=device,
                      storage=open_storage(storage, settings.adapters_dir),   # with S3: adapters_dir caches
                      leases=RedisLeases(client, settings.instance_id, settings.lease_ttl_s),
                      checkpoints=open_checkpoint_storage(storage, settings.checkpoints_dir))
    log.info("learner %s sharing tenants through Redis leases (TTL %.0f s); checkpoints %s", settings.instance_id,
             settings.lease_ttl_s, "in the S3 store" if storage.backend == "s3" else f"in {settings.checkpoints_dir}")
    if external is not None:
        learner.external = external(learner, client)
    try:
        learner.run_forever(stop)
    finally:
        stop_followers = getattr(learner.model, "stop_followers", None)
        if stop_followers is not None:
            stop_followers()
    if settings.backend == "megatron":
        from clora.learner import megatron_tp

        megatron_tp.shutdown_parallel()

"""The learner's side of the Tinker API: runs each queued request when the scheduler picks its run.

    make_tinker_work(learner, redis) -> TinkerWork     (`clora learner` passes it in)

`TinkerWork` is the learner's `ExternalWork`: every run with requests queued
(`clora.trainapi.queue`) is one more view for the learner's `Scheduler`, with its tenant's
weight and priority, and a pick runs one request on the learner's own model and swapped
`AdapterStore` (`InProcessBackend`), so Tinker runs and continuously learning tenants share the
device by one rule. The run's state lives in the store under `run_key(tenant, model_id)`.

Crash safety. A request leaves its queue only when it finishes (`queue.finish`), so a learner
killed mid-request runs it again after its restart. What must not happen twice or half:

- **State changes** (`create`, `optim_step`, `load_weights`) are checkpointed before they are
  answered, with the number of the request applied in the checkpoint (`AdapterState.cursor`,
  which a run has no other use for). A request found at the head again after a restart whose
  number the checkpoint already covers is answered without running it: no step twice.
- **Gradients** of `forward_backward` live in memory until `optim_step`. When a restart lost
  some (the run's `grad_pending` flag was up), the next `optim_step` fails with a clear error,
  drops whatever gradient was gathered since, and applies nothing: no step from half a batch.
  The client runs `forward_backward` again and steps.
- **Leases.** A run follows its tenant's lease (`clora.learner.leases`): it is scheduled only on
  the learner that holds the tenant, its checkpoints are written under the tenant's fencing
  token into the learner's checkpoint storage (`tinker/<run>`; shared across hosts with the S3
  store), and a learner that loses or takes the tenant forgets the run's state and its count of
  finished requests (`drop`), so that they are read again from the checkpoint and the queue. A
  request whose checkpoint is refused (`FencedOut`) is not finished: the new holder runs it.
- **Saved weights** are written to a temporary folder and renamed (`weights.CheckpointDir`); a
  sampler checkpoint's published version is found again by its path (or its sampling session,
  for the ephemeral form) rather than published twice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clora.fencing import FencedOut
from clora.ids import served_name
from clora.learner.adapter_store import GRAD
from clora.learner.checkpoint import run_checkpoint
from clora.learner.scheduler import TenantView
from clora.registry import Registry
from clora.storage import StorageSettings
from clora.trainapi import queue
from clora.trainapi.backend import AdamParams, InProcessBackend
from clora.trainapi.queue import Job
from clora.trainapi.sampling import get_sampling_session, put_sampling_session
from clora.trainapi.settings import TrainApiSettings
from clora.trainapi.weights import CheckpointDir, CheckpointInfo, NotFound, TinkerPath, parse_path
from clora.trainapi.wire import WireError, decode_forward_backward, forward_backward_json, \
    forward_backward_output

log = logging.getLogger(__name__)

STATE_CHANGES = frozenset({"create", "optim_step", "load"})
"""Ops whose effect is checkpointed before they are answered."""


class RequestError(ValueError):
    """A request the client must change: failed with category `user`."""


@dataclass
class RunRecord:
    tenant: str
    model_id: str
    seed: int
    done: int = 0
    """Requests of this run finished (the next one's number is `done + 1`)."""
    grad_lost: bool = False
    """A restart (or an eviction) lost gradient gathered for the next `optim_step`."""
    last_used: float = 0.0
    """When a request of this run last ran (monotonic); 0 when never on this learner."""


def make_tinker_work(learner, redis_client) -> "TinkerWork":
    return TinkerWork(learner, redis_client, TrainApiSettings(), StorageSettings())


class TinkerWork:
    """`clora.learner.external.ExternalWork` for the Tinker API's runs."""

    def __init__(self, learner, redis_client, settings: TrainApiSettings, storage: StorageSettings | None = None):
        self.learner, self.r, self.settings = learner, redis_client, settings
        self.store = learner.store
        self.backend = InProcessBackend(learner.trainer)
        self.checkpoints = CheckpointDir(settings.checkpoints_dir, storage)
        self.runs: dict[str, RunRecord] = {}
        self.restore()
        queue.publish_caps(self.r, dataclasses.asdict(self.backend.capabilities()))

    # --- what the scheduler sees -------------------------------------------------------------

    def owns(self, key: str) -> bool:
        return key in self.runs

    def views(self, registered: dict) -> list[TenantView]:
        self._discover()
        self._evict_idle()
        keys = [k for k, rec in self.runs.items() if rec.tenant in registered]
        out = []
        for key, n in queue.waiting(self.r, keys).items():
            policy = registered[self.runs[key].tenant].policy
            out.append(TenantView(key, paused=False, weight=policy.weight, priority=policy.priority,
                                  min_new_examples=1, waiting=n))
        return out

    def wait(self, timeout_s: float) -> None:
        queue.wait_for_work(self.r, timeout_s)

    def close(self) -> None:
        """Nothing to do: every state change was checkpointed when it was answered."""

    def drop(self, tenant: str) -> None:
        """Forget `tenant`'s runs (their state and finished counts are read again when needed)."""
        for key in [k for k, rec in self.runs.items() if rec.tenant == tenant]:
            if key in self.store:
                self.store.remove(key)
            del self.runs[key]

    # --- restoring ---------------------------------------------------------------------------

    def _discover(self) -> None:
        for key, info in queue.runs(self.r).items():
            if key not in self.runs:
                done, _ = queue.run_meta(self.r, key)
                self.runs[key] = RunRecord(info["tenant"], info["model_id"], int(info["seed"]), done=done)

    def restore(self) -> None:
        """Learn every run; their states load from their checkpoints when first needed."""
        self._discover()
        if self.runs:
            log.info("tinker: %d runs known", len(self.runs))

    def load(self, key: str) -> bool:
        """Bring `key`'s state into the store from its checkpoint, first evicting its tenant's
        least recently used run when the tenant holds `max_resident_runs`; whether it is there.
        A gradient gathered before the state left memory is lost: the run is marked."""
        if key in self.store:
            return True
        state = self.learner.checkpoints.load(run_checkpoint(_file_name(key)))
        if state is None:
            return False
        self._make_room(key)
        self.store.put(dataclasses.replace(state, tenant=key))
        _, self.runs[key].grad_lost = queue.run_meta(self.r, key)
        return True

    def _make_room(self, key: str) -> None:
        """Evict the least recently used runs of `key`'s tenant until one more fits its share."""
        tenant = self.runs[key].tenant
        mine = sorted((r.last_used, k) for k, r in self.runs.items() if r.tenant == tenant and k in self.store)
        for _, old in mine[:max(0, len(mine) - self.settings.max_resident_runs + 1)]:
            self.evict(old, "its tenant holds too many runs")

    def evict(self, key: str, why: str) -> None:
        """Drop `key`'s state from memory; its checkpoint holds every applied step."""
        self.store.remove(key)
        log.info("tinker run %s left the learner's memory: %s", key, why)

    def _evict_idle(self) -> None:
        cutoff = time.monotonic() - self.settings.run_idle_s
        for key, rec in self.runs.items():
            if key in self.store and rec.last_used < cutoff and self.store.active_tenant != key:
                self.evict(key, f"idle for {self.settings.run_idle_s:.0f} s")

    def _checkpoint(self, key: str, applied: int) -> None:
        """Checkpoint `key`'s state with `applied` requests in it, under its tenant's lease."""
        self._check_alive(self.runs[key].tenant)
        state = self.store.state(key)
        state.cursor = applied
        fence = self.learner.leases.check(self.runs[key].tenant)
        name = _file_name(key)
        self.learner.checkpoints.save(run_checkpoint(name), dataclasses.replace(state, tenant=name),
                                      fence.token if fence is not None else 0)

    def _deleted(self, tenant: str) -> bool:
        """Whether `tenant` is being or was deleted (its tombstone, set before its data goes)."""
        return bool(self.r.exists(Registry.tombstone_key(tenant)))

    def _check_alive(self, tenant: str) -> None:
        """Before each write of a run's data: `_TenantDeleted` once its tenant's deletion began,
        so that a request in flight then leaves no checkpoint or saved weights behind the
        deletion (`clora.trainapi.purge`)."""
        if self._deleted(tenant):
            raise _TenantDeleted(tenant)

    def _forget(self, key: str) -> None:
        """Drop a deleted tenant's run from memory."""
        if key in self.store:
            self.store.remove(key)
        self.runs.pop(key, None)

    # --- running a request -------------------------------------------------------------------

    def run(self, key: str) -> float | None:
        job = queue.head(self.r, key)
        if job is None:
            return None
        rec = self.runs[key]
        if self._deleted(rec.tenant):
            self._forget(key)
            return None
        n = rec.done + 1
        t0 = time.perf_counter()
        rec.last_used = time.monotonic()
        grad_pending: bool | None = None
        try:
            self.load(key)
            if job.op in STATE_CHANGES and key in self.store and self.store.peek(key).cursor >= n:
                result = _already_applied(job, self.store.peek(key).step)   # applied, then the learner died
            else:
                result, grad_pending = self._execute(key, rec, job, n)
            raw, js = result if isinstance(result, tuple) else (None, result)
            queue.finish(self.r, key, job.request_id, self.settings.future_ttl_s, result=raw, result_json=js,
                         grad_pending=grad_pending)
        except FencedOut:
            raise        # another learner holds the tenant now: the request is its to run
        except _TenantDeleted:
            self._forget(key)   # deleted mid-request: nothing of it written, and no answer
            return None
        except (RequestError, WireError, FileExistsError, FloatingPointError) as e:
            queue.finish(self.r, key, job.request_id, self.settings.future_ttl_s, error=str(e), category="user",
                         grad_pending=grad_pending)
        except Exception as e:  # noqa: BLE001 - one request's failure is its future's, not the learner's
            log.exception("tinker request %s (%s of %s) failed", job.request_id, job.op, key)
            queue.finish(self.r, key, job.request_id, self.settings.future_ttl_s,
                         error=f"{type(e).__name__}: {e}", category="server")
        rec.done = n
        rec.last_used = time.monotonic()
        return time.perf_counter() - t0

    def _execute(self, key: str, rec: RunRecord, job: Job, n: int) -> tuple[Any, bool | None]:
        """(result, new gradient flag or None to leave it) of `job`, the run's request number `n`.
        A result is JSON, or (protobuf bytes, JSON) for `forward_backward`."""
        a = job.args
        if job.op == "create":
            if key not in self.store:
                self._make_room(key)
            self.backend.create(key, rec.seed)
            self._checkpoint(key, n)
            return {"type": "create_model", "model_id": rec.model_id}, False
        if key not in self.store:
            raise RuntimeError(f"run {rec.model_id!r} has no state on this learner (its creation was lost)")
        if job.op == "forward_backward":
            call = decode_forward_backward(job.payload or b"")
            out = self.backend.forward_backward(key, call.data, call.loss_fn, call.loss_fn_config, call.forward_only)
            return (forward_backward_output(out), forward_backward_json(out)), (None if call.forward_only else True)
        if job.op == "optim_step":
            if rec.grad_lost:
                self._drop_gradient(key)
                rec.grad_lost = False
                raise _GradientLost("optim_step: the learner lost the gradient of this model's forward_backward "
                                    "calls since its last optim_step (it restarted, or the run left its memory: "
                                    "TrainApiSettings.max_resident_runs, run_idle_s); no step was applied and the "
                                    "gradient was cleared: run forward_backward again, then optim_step")
            p = AdamParams(**a["adam"])
            metrics = self.backend.optim_step(key, p)
            self._checkpoint(key, n)
            return {"type": "optim_step", "metrics": metrics}, False
        if job.op == "load":
            try:   # from the path, not a folder the API found: with a store, that is another host's cache
                folder, _ = self.checkpoints.find(rec.tenant, parse_path(a["path"]))
            except NotFound as e:
                raise RequestError(f"{e} (it was deleted after the request was accepted)") from e
            self.backend.load_state(key, folder, a["optimizer"])
            rec.grad_lost = False
            self._checkpoint(key, n)
            return {"type": "load_weights", "path": a["path"], **({"model_id": rec.model_id}
                                                                 if a.get("creates") else {})}, False
        if job.op == "save":
            return self._save(key, rec, job), None
        raise RequestError(f"op: unknown request {job.op!r}")

    def _drop_gradient(self, key: str) -> None:
        st = self.store.state(key)   # the host copy, flushed from the device
        st.buffer[GRAD].zero_()
        st.micro_steps = 0
        self.store.put(st)   # drops any resident copy, whose gradient must not be written back

    def _save(self, key: str, rec: RunRecord, job: Job) -> dict:
        """`save_weights` (a resumable checkpoint), or `save_weights_for_sampler`: named, a PEFT
        checkpoint published as a version of the tenant (not live), its path mapped to it; or
        ephemeral (an RL loop's every step), a version only, with a sampling session on it."""
        self._check_alive(rec.tenant)
        a = job.args
        p = TinkerPath(rec.model_id, a["kind"], a["name"])
        sampler = a["kind"] == "sampler_weights"
        if sampler and (sid := a.get("sampling_session_id")) is not None:
            if get_sampling_session(self.r, sid) is None:   # else published before a restart
                version = self._publish(key, rec, tinker_path=None)
                put_sampling_session(self.r, sid, rec.tenant, served_name(rec.tenant, version))
            return {"type": "save_weights_for_sampler", "sampling_session_id": sid}
        if sampler and self.learner.registry.tinker_sampler_version(rec.tenant, str(p)) is not None:
            return {"type": "save_weights_for_sampler", "path": str(p)}   # published before a restart
        if not (sampler and self.checkpoints.exists(rec.tenant, p)):
            caps = self.backend.capabilities()

            def fill(folder: Path) -> CheckpointInfo:
                step = self.backend.save_state(key, folder, self.learner.publisher.base_model, not sampler)
                return CheckpointInfo(path=str(p), tenant=rec.tenant, base_model=self.settings.base_model,
                                      lora_rank=caps.rank, train_attn=caps.train_attn, train_mlp=caps.train_mlp,
                                      step=step, has_optimizer=not sampler, created_at=time.time())

            self.checkpoints.write(rec.tenant, p, bool(a.get("overwrite")), fill)
        if not sampler:
            return {"type": "save_weights", "path": str(p)}
        version = self._publish(key, rec, tinker_path=str(p))
        self.learner.registry.record_tinker_sampler(rec.tenant, str(p), version)
        return {"type": "save_weights_for_sampler", "path": str(p)}

    def _publish(self, key: str, rec: RunRecord, tinker_path: str | None) -> int:
        """The run's weights as the tenant's next version, not live (`tenant@vN`); then the
        tenant's old versions pruned as after any publish (named Tinker versions are kept)."""
        st = self.store.state(key)
        publisher = self.learner.publisher
        version = publisher.publish(rec.tenant, st.master.clone(), step=st.step, examples_seen=st.examples_seen,
                                    eval_scores={}, make_live=False, source="tinker", tinker_path=tinker_path).version
        try:
            publisher.prune(rec.tenant, self.learner.s.keep_versions)
        except Exception:  # noqa: BLE001 - retention must never fail a publish; the next one retries
            log.exception("deleting %s's old versions failed", rec.tenant)
        return version


class _GradientLost(RequestError):
    pass


class _TenantDeleted(Exception):
    """The run's tenant is being deleted: the request writes nothing more."""


def _already_applied(job: Job, step: int) -> dict:
    """The answer to a state change the checkpoint already holds (the learner died before it
    could answer): what the client would have got, less what was not kept (grad_norm)."""
    if job.op == "create":
        return {"type": "create_model", "model_id": job.model_id}
    if job.op == "optim_step":
        return {"type": "optim_step", "metrics": {"step:max": float(step)}}
    return {"type": "load_weights", "path": job.args["path"],
            **({"model_id": job.model_id} if job.args.get("creates") else {})}


_file_name = queue.run_file_name
"""A run's checkpoint file name (`clora.trainapi.purge` deletes it by the same name)."""

"""A tenant's training state from registration on: `TenantLifecycle`.

- On start, torn temporary checkpoint files a crash left are removed (`restore`). A tenant is
  loaded from its newest checkpoint when it is first admitted after this learner took its lease
  (`admit`), wherever that checkpoint was written (`clora.learner.checkpoint.Checkpoints`); a
  tenant whose lease it loses or hands back is dropped from memory unsaved (`drop`). A crash
  loses at most the steps since the last checkpoint. Version numbers come from the registry and
  the adapter storage, never from the checkpoint, so they never go back.
- A tenant seen without a checkpoint is registered (`admit`): it starts from its live
  version's weights when it has one (checkpoints lost), else from its `init_adapter`
  (published first, as its v1), else from a fresh LoRA init. A tenant that cannot train (over
  capacity, or an `init_adapter` that does not fit the LoRA layout) is refused once, logged,
  and not retried.
- Checkpoints (`checkpoint`), under the tenant's lease (`FencedOut` once another learner took
  it); in fused mode the tenant's fused copy is written back first.
- Its weights are replaced by a published version's (`restore_weights`) when someone else
  chose the live version (`follow_live`: an operator's rollback or promote) or the reward
  guard rolls it back; a failed step's gradients are dropped (`drop_grads`). A live version that
  is this state's own candidate (published after the checkpoint that holds it, by a learner that
  died before it could checkpoint again) is adopted as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, MutableMapping

import torch

from clora.fencing import Fence
from clora.learner.adapter_store import EXP_AVG, GRAD, MASTER, AdapterCapacityError, AdapterState, AdapterStore
from clora.learner.checkpoint import CheckpointError, Checkpoints, tenant_checkpoint
from clora.learner.fused import FusedTrainer
from clora.learner.peft_io import AdapterFormatError
from clora.learner.publish import Publisher
from clora.learner.settings import LearnerSettings
from clora.learner.tenant import LearnerTenant

log = logging.getLogger(__name__)


def tenant_seed(tenant: str) -> int:
    """A tenant's own seed, stable across restarts and learners."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=4).digest(), "big")


class TenantLifecycle:
    def __init__(self, settings: LearnerSettings, registry, store: AdapterStore, publisher: Publisher,
                 fused: FusedTrainer | None, tenants: MutableMapping[str, LearnerTenant], checkpoints: Checkpoints,
                 fence: Callable[[str], Fence | None] = lambda tenant: None):
        self.s = settings
        self.checkpoints = checkpoints
        self.fence = fence
        """The tenant's lease a checkpoint is written under (`Leases.check`)."""
        self.registry = registry
        self.store = store
        self.publisher = publisher
        self.fused = fused
        self.tenants = tenants
        self.rejected: set[str] = set()
        """Tenants refused at registration: not offered again until the learner restarts."""

    # --- registration -------------------------------------------------------------------------

    def restore(self) -> list:
        """Drop the temporary checkpoint files a crash left (each the size of a whole checkpoint:
        left alone they would fill the disk). Returns them."""
        if partial := self.checkpoints.storage.clean_partial():
            log.warning("removed %d checkpoint file(s) a crash left half-written: %s", len(partial),
                        [p.name for p in partial])
        return partial

    def admit(self, t) -> bool:
        """Whether registry tenant `t` can train: loaded from its newest checkpoint, or registered
        when it has none, when it is not in memory; False when it was refused (now or before)."""
        if t.id in self.rejected:
            return False
        if t.id in self.store:
            return True
        if self._load(t.id):         # loaded, or refused: never registered afresh over a checkpoint
            return t.id not in self.rejected
        return self._register(t)

    def _load(self, tenant: str) -> bool:
        """Load `tenant`'s newest checkpoint into the store; False when it has none. One that
        cannot be read or does not fit is refused (logged, not retried; True): training it from
        scratch would train its data again."""
        try:
            st = self.checkpoints.load(tenant_checkpoint(tenant))
            if st is None:
                return False
            self.publisher.clean_partial(tenant)
            self.store.put(st)
        except (CheckpointError, AdapterCapacityError) as e:
            cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
            log.error("tenant %s will not train: its checkpoint cannot be loaded: %s%s", tenant, e, cause)
            self.rejected.add(tenant)
            return True     # not registered afresh
        log.info("tenant %s: resuming from its checkpoint at step %d (cursor %d)", tenant, st.step, st.cursor)
        return True

    def drop(self, tenant: str) -> None:
        """Forget `tenant` unsaved (its lease went to another learner, or is handed back after its
        checkpoint): its state leaves memory and the device, and its loop record is cleared, so
        that it is loaded from the newest checkpoint if this learner takes it again."""
        if self.fused is not None and (i := self.fused.slots.slot_of(tenant)) is not None:
            self.fused.slots.evict(i, self.store)
        if tenant in self.store:
            self.store.remove(tenant)
        self.tenants.pop(tenant, None)
        self.rejected.discard(tenant)

    def _register(self, t) -> bool:
        """Register a tenant that has no checkpoint; False (logged, not retried) when it cannot
        train: over capacity, or its `init_adapter` does not fit the base model's LoRA layout."""
        try:
            self.publisher.clean_partial(t.id)
            self.store.register(t.id, tenant_seed(t.id), self._start_weights(t))
        except (AdapterCapacityError, AdapterFormatError) as e:
            cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
            log.error("tenant %s will not train: %s%s", t.id, e, cause)
            self.rejected.add(t.id)
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
            flat = self.publisher.live_weights(t.id).flat
        except AdapterFormatError as e:
            log.warning("tenant %s has no checkpoint and its live v%d is unreadable (%s: %s); starting from a "
                        "fresh LoRA init", t.id, live, e, e.__cause__)
            return None
        log.info("tenant %s has no checkpoint: starting from its live version v%d", t.id, live)
        return flat

    # --- saving -------------------------------------------------------------------------------

    def sync(self, tenant: str) -> None:
        """In fused mode: write the tenant's fused copy back, so the store holds its newest state."""
        if self.fused is not None and self.fused.slots.slot_of(tenant) is not None:
            self.fused.flush([tenant])

    def checkpoint(self, tenant: str) -> None:
        """Save `tenant`'s state under its lease (`FencedOut` when another learner took it)."""
        self.sync(tenant)
        fence = self.fence(tenant)
        self.checkpoints.save(tenant_checkpoint(tenant), self.store.state(tenant),
                              fence.token if fence is not None else 0)
        self.tenants[tenant].dirty = False

    # --- replacing what it trains on ----------------------------------------------------------

    def follow_live(self, tid: str) -> None:
        """Train on from the live version when someone else chose it: an operator's rollback or
        promote (`clora tenant rollback`, the console) changes only the registry; without this
        the next publish would put the abandoned weights' descendant live again."""
        st = self.store.peek(tid)
        ours = st.last_published_version
        live = self.registry.live_version(tid)
        if live is None or live == ours:
            return
        if self._own_candidate(tid, st, live):
            st.last_published_version = live
            st.feedback_window = st.lineage = None     # as the publish would have left them
            self.tenants[tid].dirty = True
            log.info("%s's live v%d was published from this state before its learner could checkpoint again: "
                     "adopted", tid, live)
            return
        if ours is None:
            return
        try:
            self.restore_weights(tid, self.publisher.weights(tid, live), live)
            log.warning("%s's live version is v%d, not v%d it last published: training on from v%d", tid, live,
                        ours, live)
        except AdapterFormatError as e:
            st.last_published_version = live  # not asked again: trains on from its own weights
            log.error("%s's live v%d is unreadable (%s); training on from its own weights", tid, live, e)

    def _own_candidate(self, tid: str, st: AdapterState, live: int) -> bool:
        """Whether live version `live` was published from exactly `st`: the publish gate
        checkpoints a candidate before publishing it, so a learner that died between the publish
        and its next checkpoint leaves a state whose step, examples seen and parent match the
        version it published."""
        meta = next((v for v in self.registry.adapter_versions(tid) if v.version == live), None)
        return (meta is not None and meta.source is None and meta.imported_from is None and meta.step == st.step
                and meta.examples_seen == st.examples_seen and meta.parent_version == st.last_published_version)

    def restore_weights(self, tenant: str, flat: torch.Tensor, version: int) -> None:
        """Train on from `flat` (a published version's weights): the master weights are replaced
        and Adam's momentum is cleared (it points along the abandoned trajectory); the second
        moments and the step count stay, so the per-parameter scale stays calibrated and the
        first updates ramp up as momentum rebuilds. Steps, examples seen and the cursor stay:
        the data consumed since is not trained on again. Checkpointed at once."""
        st, buffer = self._state_to_edit(tenant)
        buffer[MASTER].copy_(flat)
        buffer[EXP_AVG].zero_()
        buffer[GRAD].zero_()
        self.store.put(dataclasses.replace(st, buffer=buffer, micro_steps=0,
                                           feedback_window=None, lineage=None,  # its data is not in these weights
                                           last_published_version=version))  # the weights it trains on from
        self.checkpoint(tenant)

    def drop_grads(self, tenant: str) -> None:
        """Forget what a failed step had accumulated, so that its next step starts clean."""
        if tenant not in self.store:
            return
        st, buffer = self._state_to_edit(tenant)
        buffer[GRAD].zero_()
        self.store.put(dataclasses.replace(st, buffer=buffer, micro_steps=0))

    def _state_to_edit(self, tenant: str) -> tuple[AdapterState, torch.Tensor]:
        """(the tenant's state, a copy of its buffer (4, P)): its fused copy is written back and
        dropped first, so that the caller's `store.put` of the edited copy is the only one left."""
        if self.fused is not None and (i := self.fused.slots.slot_of(tenant)) is not None:
            self.fused.slots.evict(i, self.store)
        st = self.store.state(tenant)
        return st, st.buffer.clone()

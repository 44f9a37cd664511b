"""Fused mode in the scheduler and the learner loop."""

from __future__ import annotations

import torch

from clora.learner.adapter_store import MASTER
from clora.learner.scheduler import Scheduler, TenantView
from clora.learner.settings import LearnerSettings

from .helpers import checkpointed, checkpointed_tenants
from .test_process import _learner


def test_pick_group_takes_the_k_smallest_virtual_times_and_skips_ineligible():
    clock = [0.0]
    s = Scheduler(clock=lambda: clock[0])
    views = [TenantView(t, False, 1.0, 0, 1, 5) for t in ("a", "b", "c")] + [TenantView("p", True, 1.0, 0, 1, 5)]
    first = s.pick_group(views, 2)
    assert first.tenants == ("a", "b") and first.skipped == {"p": "paused"}
    for t in first.tenants:
        s.record(t, 1.0)
    assert s.pick_group(views, 2).tenants == ("c", "a")  # c has not run yet: it goes first
    assert s.pick_group([TenantView("p", True, 1.0, 0, 1, 5)], 3).tenants == ()


def test_learner_in_fused_mode_trains_tenants_together_and_publishes(world, tiny_model_dir):
    settings, reg, buf = world
    fused_world = (settings.model_copy(update={"training_mode": "fused", "fused_max_tenants": 2,
                                                "fused_max_chunk_tokens": 64}), reg, buf)
    events = []
    lr = _learner(fused_world, tiny_model_dir, events)
    assert lr.fused is not None and lr.fused.max_tenants == 2 and lr.fused.max_chunk_tokens == 64
    trained = [lr.tick_fused() for _ in range(4)]
    # acme (SFT) and beta (DPO) train in the same fused step, 3 fresh batches each, then wait
    assert trained[:3] == [("acme", "beta")] * 3 and trained[3] == ()
    assert lr.store.peek("acme").step == 3 and lr.store.peek("beta").step == 3
    assert reg.live_version("acme") is not None and reg.live_version("beta") is not None
    assert {e.tenant for e in events} == {"acme", "beta"}
    lr.shutdown()
    # the checkpoints hold the fused-trained state, not the stale host copy from before the step
    assert checkpointed_tenants(settings) == ["acme", "beta"]
    for tenant in checkpointed_tenants(settings):
        st = checkpointed(settings, tenant, lr.model.layout.numel)
        assert st.step == 3
        assert torch.equal(st.buffer[MASTER], lr.fused.slots.master[lr.fused.slots.slot_of(st.tenant)])


def test_fused_settings_default_to_serial():
    s = LearnerSettings(metrics_port=0)
    assert s.training_mode == "serial" and s.fused_max_tenants == 4 and s.fused_backend == "auto"
    assert s.fused_max_chunk_tokens is None      # the device's default (1,024 on CPU, 16,384 on CUDA)

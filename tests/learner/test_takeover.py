"""What a learner taking a tenant over finds when the one before died between a publish and the
checkpoint after it: the newest checkpoint holds exactly the published weights (the gate
checkpoints before it publishes), so the successor adopts the live version as its own, with its
optimizer state, trains nothing again and publishes the next number."""

from __future__ import annotations

import torch

from clora.learner.adapter_store import EXP_AVG, MASTER

from .helpers import checkpointed
from .test_process import _learner


class Killed(BaseException):
    """kill -9: nothing after it runs (not even the loop's `except Exception`)."""


def test_a_version_published_just_before_its_learner_died_is_adopted_not_trained_again(world, tiny_model_dir):
    settings, reg, buf = world
    first = _learner(world, tiny_model_dir, [])
    real_publish = first.publisher.publish

    def publish_then_die(*args, **kwargs):
        real_publish(*args, **kwargs)
        raise Killed

    first.publisher.publish = publish_then_die
    try:
        while True:
            first.tick()
    except Killed:
        pass
    (tenant, published), = reg.live.items()
    saved = checkpointed(settings, tenant, first.model.layout.numel)       # written before the publish
    assert saved.last_published_version is None and saved.step == 1 and published == 1
    assert torch.equal(saved.buffer[MASTER], first.publisher.weights(tenant, published))

    second = _learner(world, tiny_model_dir, [])
    assert second.lifecycle.admit(reg.get_tenant(tenant))
    second.lifecycle.follow_live(tenant)
    st = second.store.state(tenant)
    assert st.last_published_version == published and st.lineage is None and st.feedback_window is None
    assert torch.equal(st.buffer[EXP_AVG], saved.buffer[EXP_AVG]) and st.buffer[EXP_AVG].abs().sum() > 0   # kept
    while second.tick() is not None:
        pass
    versions = reg.adapter_versions(tenant)
    assert [v.version for v in versions] == [1, 2, 3] and [v.parent_version for v in versions] == [None, 1, 2]
    assert [v.examples_seen for v in versions] == [4, 8, 12]                  # 12 examples, each trained once

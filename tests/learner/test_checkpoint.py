"""Checkpoints: a tenant's publishing lineage survives a restart, in the file's `extras` object."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from clora.learner.adapter_store import ROWS, AdapterState
from clora.learner.checkpoint import load_checkpoint, save_checkpoint

P = 8


def _state(**lineage) -> AdapterState:
    return AdapterState(tenant="acme", seed=1, buffer=torch.arange(ROWS * P, dtype=torch.float32).view(ROWS, P),
                        rng_state=torch.Generator().manual_seed(1).get_state(), step=3, cursor=12, **lineage)


def test_the_publishing_lineage_round_trips_as_the_extras_object(tmp_path):
    path = save_checkpoint(tmp_path, _state(last_published_version=2, feedback_window=(10.0, 12.5)), P)
    with safe_open(path, "pt") as f:
        extras = json.loads(f.metadata()["clora_state"])["extras"]
    assert extras == {"last_published_version": 2, "feedback_window": [10.0, 12.5]}
    back = load_checkpoint(path, P)
    assert (back.last_published_version, back.feedback_window) == (2, (10.0, 12.5))
    assert (back.step, back.cursor) == (3, 12) and torch.equal(back.buffer, _state().buffer)


def test_a_tenant_that_never_published_has_no_lineage(tmp_path):
    path = save_checkpoint(tmp_path, _state(), P)
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["clora_state"])["extras"] == {}
    back = load_checkpoint(path, P)
    assert back.last_published_version is None and back.feedback_window is None

"""Fixtures for learner tests: one tiny Llama model per session, built offline in ~1 s."""

from __future__ import annotations

import pytest
import torch

from clora.learner.base_model import load_base_model, make_tiny_model

from .helpers import learner_world


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture()
def tiny(tiny_model_dir):
    """A fresh (model, tokenizer) pair: tests may wrap the model with LoRA."""
    torch.set_num_threads(2)
    return load_base_model(tiny_model_dir)


@pytest.fixture()
def world(tmp_path):
    """(settings, registry, buffer) of a learner: see `helpers.learner_world`."""
    return learner_world(tmp_path)

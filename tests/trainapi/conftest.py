"""Fixtures for the Tinker-compatible training API: the app on the tiny model, served by uvicorn
in a thread, with an in-memory key table (the registry's Tinker keys are tested on their own)."""

from __future__ import annotations

import os

import pytest
import torch

from clora.learner.adapter_store import AdapterStore
from clora.learner.base_model import load_base_model, make_tiny_model
from clora.learner.batches import ChatEncoder
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainerConfig
from clora.registry import ApiKeyPrincipal
from clora.trainapi.app import create_app
from clora.trainapi.backend import InProcessBackend
from clora.trainapi.settings import TrainApiSettings
from tests.fakes import ServerThread

KEYS = {"tml-acme-key": "acme", "tml-beta-key": "beta"}
RANK = 8


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture()
def service(tiny_dir, monkeypatch, tmp_path):
    """(url, backend) of a fresh training API on the tiny model."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    torch.set_num_threads(1)
    model, tok = load_base_model(tiny_dir)
    lm = LoraModel(model, LoraSpec(rank=RANK))
    backend = InProcessBackend(Trainer(lm, ChatEncoder(tok, 64), AdapterStore(lm, prefetch=False),
                                       TrainerConfig(micro_batch_size=4)))
    settings = TrainApiSettings(base_model="tiny", tokenizer_id=str(tiny_dir), retrieve_hold_s=0.5,
                                max_body_bytes=64 * 1024, max_decompressed_bytes=256 * 1024,
                                fwdbwd_max_chunk_bytes=64 * 1024, checkpoints_dir=tmp_path / "checkpoints")

    def authenticate(key: str) -> ApiKeyPrincipal | None:
        tenant = KEYS.get(key)
        return ApiKeyPrincipal(tenant=tenant, key_id="k") if tenant else None

    with ServerThread(create_app(settings, authenticate, backend), lifespan="auto") as server:
        yield server.url, backend

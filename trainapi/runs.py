"""The training API's sessions and models: who owns what, and each model's order of requests.

A session belongs to the tenant whose Tinker key created it; a model to its session's tenant.
Model ids are `{session_id}:train:{model_seq_id}`, the format the SDK itself builds on the
client (docs/tinker-protocol.md §4.2). A model id of another tenant is answered as unknown.
These records live in the service's memory (phase 1): a restart forgets them, and their ids then
answer 404 or 410.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from clora.trainapi.sequencer import Sequencer


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


@dataclass
class Session:
    session_id: str
    tenant: str
    sdk_version: str | None = None
    created_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: str | None = None
    """Why it finished (`success`, `errored`, `interrupted`), None while open."""


@dataclass
class TinkerModel:
    """One Tinker training run: a LoRA adapter under its tenant (`backend.run_key`)."""

    model_id: str
    session_id: str
    tenant: str
    key: str
    """Its state's key in the backend's store."""
    rank: int
    create_request_id: str
    sequencer: Sequencer
    train_unembed_requested: bool = False
    """The client asked for the unembedding to train; clora trains attention and MLP only."""

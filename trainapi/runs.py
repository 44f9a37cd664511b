"""The training API's sessions and models: who owns what, and each model's order of requests.

A session belongs to the tenant whose Tinker key created it; a model to its session's tenant.
Model ids are `{session_id}:train:{model_seq_id}`, the format the SDK itself builds on the
client (docs/tinker-protocol.md §4.2). A model id of another tenant is answered as unknown.
The service keeps them in memory and in Redis (`RunStore`): a restarted service loads every
session, model and model's `seq_id` order back before it answers, so a client's session goes on.

    clora:tinker:session:{session_id}   JSON of a `Session`
    clora:tinker:runs                   hash run key -> JSON of a `TinkerModel` and its seed
                                        (the learner reads tenant, model_id and seed from it)
    clora:tinker:seq:{run key}          hash "next" -> the next seq_id; "<seq_id>" -> JSON of what
                                        it led to ({"request_id"} or {"refused": [status, field,
                                        message]}), the last `keep` of them
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from clora.trainapi.queue import PREFIX, RUNS
from clora.trainapi.sequencer import Admitted, Sequencer


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


def session_key(session_id: str) -> str:
    return f"{PREFIX}:session:{session_id}"


def seq_key(run: str) -> str:
    return f"{PREFIX}:seq:{run}"


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class RunStore:
    """Sessions, models and their seq_id order in Redis (a `redis.asyncio.Redis`)."""

    def __init__(self, redis, keep: int):
        self.r, self.keep = redis, keep

    async def save_session(self, s: Session) -> None:
        await self.r.set(session_key(s.session_id), json.dumps(dataclasses.asdict(s)))

    async def save_model(self, m: TinkerModel, seed: int) -> None:
        record = {k: v for k, v in dataclasses.asdict(m).items() if k != "sequencer"}
        await self.r.hset(RUNS, m.key, json.dumps(record | {"seed": seed}))

    def seq_ops(self, m: TinkerModel, seq_id: int, admitted: Admitted):
        """What recording `seq_id` of `m` writes, as a function of a pipeline (so that it joins
        the transaction enqueueing the request it accepted)."""
        value = {"request_id": admitted.request_id} if admitted.request_id is not None \
            else {"refused": list(admitted.refused)}

        def ops(p) -> None:
            p.hset(seq_key(m.key), mapping={str(seq_id): json.dumps(value), "next": seq_id + 1})
            if seq_id - self.keep >= 0:
                p.hdel(seq_key(m.key), str(seq_id - self.keep))
        return ops

    async def record_seq(self, m: TinkerModel, seq_id: int, admitted: Admitted) -> None:
        async with self.r.pipeline(transaction=True) as p:
            self.seq_ops(m, seq_id, admitted)(p)
            await p.execute()

    async def load(self) -> tuple[dict[str, Session], dict[str, TinkerModel]]:
        """Every session and model saved, each model with its seq_id order."""
        sessions: dict[str, Session] = {}
        async for key in self.r.scan_iter(match=session_key("*"), count=500):
            raw = await self.r.get(key)
            if raw:
                s = Session(**json.loads(raw))
                sessions[s.session_id] = s
        models: dict[str, TinkerModel] = {}
        for run, raw in (await self.r.hgetall(RUNS)).items():
            rec: dict[str, Any] = json.loads(raw)
            if "session_id" not in rec:
                continue
            seq = {_text(k): json.loads(v) for k, v in (await self.r.hgetall(seq_key(_text(run)))).items()}
            nxt = int(seq.pop("next", 1))
            seen = {int(k): Admitted(request_id=v.get("request_id"),
                                     refused=tuple(v["refused"]) if "refused" in v else None) for k, v in seq.items()}
            fields = {f.name for f in dataclasses.fields(TinkerModel)} - {"sequencer"}
            models[rec["model_id"]] = TinkerModel(**{k: v for k, v in rec.items() if k in fields},
                                                  sequencer=Sequencer(first=nxt, keep=self.keep, seen=seen))
        return sessions, models

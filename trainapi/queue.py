"""The Tinker requests' road from the API process to the learner, in Redis.

The API process accepts a request, puts it in its model's order and enqueues it here; the
learner process, when its scheduler picks that model, runs the request at the head of the
queue and finishes it; the API answers `retrieve_future` from the finished record. Nothing
accepted lives only in a process's memory: a learner that dies mid-request finds the request
still at the head when it comes back (`clora.trainapi.executor`).

Keys (`run` = `backend.run_key(tenant, model_id)`, `rid` = the request id the client polls):

    clora:tinker:runs          hash  run -> {"tenant", "model_id", "seed", ...} (JSON): every run
                                     (`clora.trainapi.runs.RunStore` writes it)
    clora:tinker:q:{run}       list  request ids waiting, in seq_id order; the head runs next
    clora:tinker:req:{rid}     hash  the request and, once finished, its outcome (its future):
                                     tenant, model_id, kind, op, args (JSON), payload (bytes),
                                     state (pending | done | failed), result (bytes),
                                     result_json, error, category
    clora:tinker:run:{run}     hash  done (requests finished), grad_pending ("1" while a
                                     forward_backward's gradient waits for its optim_step)
    clora:tinker:wake          list  a token per enqueue, so an idle learner wakes at once
    clora:tinker:finished      pub/sub channel: each finished request's id, published in the
                               transaction that records its outcome, so a held
                               `retrieve_future` answers at once (`FinishedWaiter`)

A request is enqueued in one transaction (record, queue, wake-up) and finished in one (outcome,
pop, counters), so no request is lost between the two processes or counted twice. A finished
record expires `ttl_s` later; an id without a record answers 410. Clients must not decode
responses (payloads and results are bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

PREFIX = "clora:tinker"
RUNS = f"{PREFIX}:runs"
WAKE = f"{PREFIX}:wake"
FINISHED = f"{PREFIX}:finished"
Kind = Literal["json", "forward_backward", "sample"]
"""How a result renders: `json` as `result_json`; the others as the protobuf `result` to a
client that accepts protobuf, else as `result_json`."""
ErrorCategory = Literal["user", "server", "unknown"]
OUTCOME_FIELDS = ("tenant", "model_id", "kind", "state", "result", "result_json", "error", "category")


def queue_key(run: str) -> str:
    return f"{PREFIX}:q:{run}"


def request_key(rid: str) -> str:
    return f"{PREFIX}:req:{rid}"


def run_meta_key(run: str) -> str:
    return f"{PREFIX}:run:{run}"


def run_file_name(run: str) -> str:
    """A run's file-safe name: its tenant and a digest of its key (model ids hold ':').
    Example: "acme/tinker/9f..:train:0" -> "acme--5d41402abc4b2a76b9719d91"."""
    tenant = run.split("/", 1)[0]
    return f"{tenant}--{hashlib.sha256(run.encode()).hexdigest()[:24]}"


def run_checkpoint_name(run: str) -> str:
    """Where the learner checkpoints a run's state in its checkpoint storage
    (`clora.learner.checkpoint.run_checkpoint` of `run_file_name`)."""
    return f"tinker/{run_file_name(run)}"


@dataclass(frozen=True)
class Job:
    """One queued request as the learner reads it."""

    request_id: str
    tenant: str
    model_id: str
    op: str
    args: dict[str, Any]
    payload: bytes | None


@dataclass(frozen=True)
class Outcome:
    """A request's record as `retrieve_future` reads it."""

    tenant: str
    model_id: str
    kind: Kind
    state: Literal["pending", "done", "failed"]
    result: bytes | None
    result_json: Any
    error: str | None
    category: ErrorCategory


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


# --- the API process (redis.asyncio) ------------------------------------------------------------

async def enqueue(r, run: str, rid: str, tenant: str, model_id: str, kind: Kind, op: str,
                  args: dict[str, Any], payload: bytes | None = None, also=None) -> None:
    """Record request `rid` and append it to `run`'s queue, in one transaction (with what
    `also(pipeline)` adds to it: the model's seq_id record)."""
    record = {"tenant": tenant, "model_id": model_id, "kind": kind, "op": op, "args": json.dumps(args),
              "state": "pending"}
    if payload is not None:
        record["payload"] = payload
    async with r.pipeline(transaction=True) as p:
        p.hset(request_key(rid), mapping=record)
        p.rpush(queue_key(run), rid)
        p.lpush(WAKE, 1)
        p.ltrim(WAKE, 0, 0)
        if also is not None:
            also(p)
        await p.execute()


async def outcome(r, rid: str) -> Outcome | None:
    """Request `rid`'s record, None when unknown or expired."""
    values = await r.hmget(request_key(rid), list(OUTCOME_FIELDS))
    rec = dict(zip(OUTCOME_FIELDS, values))
    if rec["state"] is None:
        return None
    rj = _text(rec["result_json"])
    return Outcome(tenant=_text(rec["tenant"]), model_id=_text(rec["model_id"]), kind=_text(rec["kind"]),
                   state=_text(rec["state"]), result=rec["result"], result_json=json.loads(rj) if rj else None,
                   error=_text(rec["error"]), category=_text(rec["category"]) or "unknown")


async def create_future(r, rid: str, tenant: str, model_id: str | None, kind: Kind, ttl_s: float) -> None:
    """A pending future that something other than the learner finishes (`complete`): sampling.
    It expires `ttl_s` after creation even unfinished (its process died), answering 410 then."""
    async with r.pipeline(transaction=True) as p:
        p.hset(request_key(rid), mapping={"tenant": tenant, "model_id": model_id or "", "kind": kind,
                                          "state": "pending"})
        p.expire(request_key(rid), max(1, int(ttl_s)))
        await p.execute()


async def complete(r, rid: str, ttl_s: float, *, result: bytes | None = None, result_json: Any = None,
                   error: str | None = None, category: ErrorCategory = "unknown") -> None:
    """Finish a future made by `create_future`: done with its result, or failed with `error`."""
    fields = _outcome_fields(result, result_json, error, category)
    async with r.pipeline(transaction=True) as p:
        p.hset(request_key(rid), mapping=fields)
        p.expire(request_key(rid), max(1, int(ttl_s)))
        p.publish(FINISHED, rid)
        await p.execute()


def _outcome_fields(result: bytes | None, result_json: Any, error: str | None, category: ErrorCategory) -> dict:
    fields: dict[str, Any] = {"state": "failed" if error is not None else "done"}
    if error is not None:
        fields |= {"error": error, "category": category}
    if result is not None:
        fields["result"] = result
    if result_json is not None:
        fields["result_json"] = json.dumps(result_json)
    return fields


class FinishedWaiter:
    """Wakes held `retrieve_future` calls when their request finishes: one subscription to
    `FINISHED` per API process (opened by `start`, reopened after a failure) instead of each
    held call reading its record every few milliseconds. A wake-up is a hint: the caller reads
    the outcome from the record, and looks again every so often whatever the channel says, so a
    message lost while the subscription reconnects costs at most that long.

        with waiter.watch(rid) as woken:        # before reading the record: no wake-up missed
            ...read the outcome; while pending: await asyncio.wait_for(woken.wait(), poll_s)
    """

    def __init__(self, r):
        self.r = r
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    @contextlib.contextmanager
    def watch(self, rid: str) -> Iterator[asyncio.Event]:
        """An event set when `rid` finishes (clear it after each wake-up to wait again)."""
        self.start()
        event = asyncio.Event()
        self._waiting.setdefault(rid, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(rid)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[rid]

    def start(self) -> None:
        """Open the subscription (on the running loop) unless it is open."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def subscribed(self) -> None:
        """Return once the subscription is open (tests; a request need not wait for it)."""
        self.start()
        await self._ready.wait()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(FINISHED)
                self._ready.set()
                for events in list(self._waiting.values()):   # what finished while it was closed
                    for event in events:
                        event.set()
                while True:
                    msg = await pubsub.get_message(timeout=30.0)
                    if msg is not None and msg.get("type") == "message":
                        for event in self._waiting.get(_text(msg["data"]), ()):
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the fallback poll covers the gap; reconnect
                log.warning("tinker: the finished-request channel failed (%s); resubscribing", e)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


# --- the learner process (redis.Redis) -------------------------------------------------------

def runs(r) -> dict[str, dict[str, Any]]:
    """Every run: key -> {"tenant", "model_id", "seed"}."""
    return {_text(k): json.loads(v) for k, v in r.hgetall(RUNS).items()}


def waiting(r, keys: list[str]) -> dict[str, int]:
    """Requests queued per run."""
    with r.pipeline(transaction=False) as p:
        for k in keys:
            p.llen(queue_key(k))
        return dict(zip(keys, p.execute()))


def run_meta(r, run: str) -> tuple[int, bool]:
    """(requests finished, a gradient waiting for its optim_step) of `run`."""
    done, pending = r.hmget(run_meta_key(run), ["done", "grad_pending"])
    return int(done or 0), _text(pending) == "1"


def head(r, run: str) -> Job | None:
    """The request at the head of `run`'s queue, None when it is empty. A head whose record is
    gone (it cannot be, short of someone deleting it) is dropped."""
    while (rid := _text(r.lindex(queue_key(run), 0))) is not None:
        rec = {_text(k): v for k, v in r.hgetall(request_key(rid)).items()}
        if rec.get("op") is not None:
            return Job(request_id=rid, tenant=_text(rec["tenant"]), model_id=_text(rec["model_id"]),
                       op=_text(rec["op"]), args=json.loads(rec["args"]), payload=rec.get("payload"))
        r.lrem(queue_key(run), 1, rid)
    return None


def finish(r, run: str, rid: str, ttl_s: float, *, result: bytes | None = None, result_json: Any = None,
           error: str | None = None, category: ErrorCategory = "unknown", grad_pending: bool | None = None) -> None:
    """Request `rid` (the head of `run`'s queue) finished: its outcome recorded (done, or failed
    with `error`), its payload dropped, it leaves the queue, `run`'s finished count grows and,
    when given, its gradient flag is set; all in one transaction."""
    fields = _outcome_fields(result, result_json, error, category)
    with r.pipeline(transaction=True) as p:
        p.hset(request_key(rid), mapping=fields)
        p.hdel(request_key(rid), "payload", "args")
        p.expire(request_key(rid), max(1, int(ttl_s)))
        p.lpop(queue_key(run))
        p.hincrby(run_meta_key(run), "done", 1)
        if grad_pending is not None:
            p.hset(run_meta_key(run), "grad_pending", "1" if grad_pending else "0")
        p.publish(FINISHED, rid)
        p.execute()


def wait_for_work(r, timeout_s: float) -> None:
    """Block until a request is enqueued or `timeout_s` passed."""
    r.blpop([WAKE], timeout=max(timeout_s, 0.01))


# --- what the learner can hold ------------------------------------------------------------------

CAPS = f"{PREFIX}:caps"
"""The learner's `LoraCapabilities` (JSON), written when it starts: the API checks
`create_model` and `forward_backward` against them without holding the model itself."""


def publish_caps(r, caps: dict[str, Any]) -> None:
    r.set(CAPS, json.dumps(caps))


async def read_caps(r) -> dict[str, Any] | None:
    raw = await r.get(CAPS)
    return json.loads(raw) if raw else None

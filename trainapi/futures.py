"""Request futures and the long poll of `retrieve_future` (docs/tinker-protocol.md §5).

Every training request answers at once with a request id; its result is fetched later. A
`Future` is pending until the worker finishes it, then done (a result) or failed (an error and
its category). `FutureStore.wait` holds a pending one up to the configured time, so a client
polls about once per hold rather than in a busy loop; the route then answers 408 `try_again`.
A finished future is kept `ttl_s` after it finished; an id unknown or expired is 410.

Everything here runs on the event loop's thread: the worker hands results back through it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

ErrorCategory = Literal["user", "server", "unknown"]


@dataclass
class Future:
    """One request's outcome. `kind` says how its result renders: `json` as is, and
    `forward_backward` as protobuf (or JSON for SDKs before 0.25)."""

    request_id: str
    tenant: str
    model_id: str | None
    kind: Literal["json", "forward_backward"]
    state: Literal["pending", "done", "failed"] = "pending"
    result: Any = None
    error: str | None = None
    category: ErrorCategory = "unknown"
    finished_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class FutureStore:
    def __init__(self, ttl_s: float, max_finished: int):
        self.ttl_s, self.max_finished = ttl_s, max_finished
        self._futures: dict[str, Future] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()   # request id -> finished at, oldest first

    def create(self, tenant: str, model_id: str | None, kind: Literal["json", "forward_backward"]) -> Future:
        f = Future(request_id=str(uuid.uuid4()), tenant=tenant, model_id=model_id, kind=kind)
        self._futures[f.request_id] = f
        return f

    def get(self, request_id: str) -> Future | None:
        """The future, or None when unknown or expired."""
        self._expire()
        return self._futures.get(request_id)

    def complete(self, request_id: str, result: Any) -> None:
        self._finish(request_id, "done", result=result)

    def fail(self, request_id: str, error: str, category: ErrorCategory) -> None:
        self._finish(request_id, "failed", error=error, category=category)

    def _finish(self, request_id: str, state: Literal["done", "failed"], **outcome: Any) -> None:
        f = self._futures.get(request_id)
        if f is None or f.state != "pending":
            return
        f.state, f.finished_at = state, time.time()
        for k, v in outcome.items():
            setattr(f, k, v)
        f.done.set()
        self._finished[request_id] = f.finished_at
        self._expire()

    async def wait(self, f: Future, hold_s: float) -> Future:
        """`f` once finished, or still pending after `hold_s`."""
        if f.state == "pending" and hold_s > 0:
            try:
                await asyncio.wait_for(f.done.wait(), hold_s)
            except TimeoutError:
                pass
        return f

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_s
        while self._finished:
            rid, at = next(iter(self._finished.items()))
            if at >= cutoff and len(self._finished) <= self.max_finished:
                break
            del self._finished[rid]
            self._futures.pop(rid, None)

"""Client of the feedback webhook: sends `FeedbackIn` records for one tenant.

`POST {base_url}/v1/feedback` (one record) and `/v1/feedback/batch` (`{"records": [...]}`)
with `Authorization: Bearer <tenant key>`. The webhook answers 202 once the broker
stored the records and 503 (with Retry-After) when it did not; a 503, a 502/504 or a
broken connection is retried with backoff, resending the same records with the same
event ids (the webhook is idempotent on them, so nothing is stored twice). Any other
answer raises `FeedbackRejected` with the status and the webhook's error message.

Every record gets a client-side event id before its first send (`new_id("fb")` unless
the caller chose one); `send*` returns the ids in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from clora.ids import new_id
from clora.ingest.schemas import FeedbackIn

RETRY_STATUSES = (502, 503, 504)


class FeedbackError(RuntimeError):
    """Feedback could not be delivered."""


class FeedbackRejected(FeedbackError):
    """The webhook refused the records (4xx, or a 5xx that is not worth retrying)."""

    def __init__(self, status: int, message: str, event_ids: list[str]):
        super().__init__(f"webhook rejected {len(event_ids)} feedback record(s) {event_ids[:3]}"
                         f"{'...' if len(event_ids) > 3 else ''} with {status}: {message}")
        self.status, self.event_ids = status, event_ids


class FeedbackUnavailable(FeedbackError):
    """The webhook kept answering 503 (or was unreachable) through every retry."""


class FeedbackClient:
    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 10.0, max_attempts: int = 6,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, batch_size: int = 200,
                 transport: httpx.BaseTransport | None = None, sleep: Callable[[float], None] = time.sleep):
        if max_attempts < 1 or batch_size < 1:
            raise ValueError(f"max_attempts ({max_attempts}) and batch_size ({batch_size}) must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self.batch_size, self._sleep = batch_size, sleep
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def __enter__(self) -> "FeedbackClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, record: FeedbackIn | dict[str, Any]) -> str:
        """Send one record; returns its event id once the webhook stored it."""
        rec = _with_event_id(record)
        self._post("/v1/feedback", rec.model_dump(mode="json", exclude_none=True), [rec.event_id])
        return rec.event_id

    def send_batch(self, records: Iterable[FeedbackIn | dict[str, Any]]) -> list[str]:
        """Send records in batches of `batch_size`; returns every event id, in order."""
        recs = [_with_event_id(r) for r in records]
        ids: list[str] = []
        for i in range(0, len(recs), self.batch_size):
            chunk = recs[i:i + self.batch_size]
            chunk_ids = [r.event_id for r in chunk]
            body = {"records": [r.model_dump(mode="json", exclude_none=True) for r in chunk]}
            self._post("/v1/feedback/batch", body, chunk_ids)
            ids += chunk_ids
        return ids

    def _post(self, path: str, body: dict[str, Any], event_ids: list[str]) -> None:
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            retry_after = None
            try:
                r = self._http.post(path, json=body)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code in (200, 201, 202):
                    return
                if r.status_code not in RETRY_STATUSES:
                    raise FeedbackRejected(r.status_code, _error_message(r), event_ids)
                last, retry_after = f"{r.status_code}: {_error_message(r)}", _retry_after(r)
            if attempt < self.max_attempts:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                self._sleep(max(delay, min(retry_after or 0.0, self.max_backoff_s)))
        raise FeedbackUnavailable(f"POST {self.base_url}{path} with {len(event_ids)} record(s) failed "
                                  f"{self.max_attempts} times; last: {last}")


def _with_event_id(record: FeedbackIn | dict[str, Any]) -> FeedbackIn:
    rec = record if isinstance(record, FeedbackIn) else FeedbackIn.model_validate(record)
    return rec if rec.event_id else rec.model_copy(update={"event_id": new_id("fb")})


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error") or {}
        msg = err.get("message") or r.text
        return f"{msg} (field {err['field']})" if err.get("field") else msg
    except (ValueError, AttributeError):
        return r.text[:500]


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return float(r.headers["retry-after"])
    except (KeyError, ValueError):
        return None

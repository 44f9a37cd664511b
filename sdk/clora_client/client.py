"""`FeedbackClient` (and `AsyncFeedbackClient`): sends one tenant's feedback to the webhook.

    with FeedbackClient("https://webhook.example", api_key, signing_secret=secret) as fb:
        fb.thumbs(completion, up=True)
        fb.send_batch(records)

`POST {base_url}/v1/feedback` (one record) and `/v1/feedback/batch` (`{"records": [...]}`)
with `Authorization: Bearer <tenant key>`, signed when the tenant has a signing secret
(`clora_client.signing`). The webhook answers 202 once the records are stored.

Every record gets an event id before its first send (`new_event_id()` unless the caller chose
one), and every retry resends the same records with the same ids: the platform stores each
event id once, so a retry after a lost answer stores nothing twice. Retried, with exponential
back-off and jitter (tenacity): a broken connection or timeout, 429 and any 5xx, waiting at
least the answer's Retry-After. Any other answer raises at once (`clora_client.errors`).
`send_batch` splits the records into requests of at most `batch_size` records and
`max_body_bytes` bytes, the webhook's limits (1000 records and 1 MiB by default).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

from clora_client import records as build
from clora_client.errors import AuthenticationError, FeedbackRejected, FeedbackUnavailable
from clora_client.ids import new_event_id
from clora_client.models import FeedbackRecord, RecordLike, to_record
from clora_client.signing import signature_headers

__version__ = "0.1.0"

MAX_BATCH = 1000
"""The webhook's default limit on records per batch request (`WebhookSettings.max_batch`)."""
MAX_BODY_BYTES = 1_048_576
"""The webhook's default limit on a request body (`WebhookSettings.max_body_bytes`)."""
_ENVELOPE = len(b'{"records":[]}')


@dataclass(frozen=True)
class _Request:
    """One POST's worth of records, encoded once so that every attempt sends the same bytes:
    `path` "/v1/feedback/batch", `body` b'{"records":[{...},{...}]}', `event_ids` ["fb-1", "fb-2"]."""

    path: str
    body: bytes
    event_ids: list[str]


class _RetryableAnswer(Exception):
    """A 429 or 5xx: worth another attempt, after at least `retry_after` seconds."""

    def __init__(self, status: int, message: str, retry_after: float | None):
        super().__init__(f"{status}: {message}")
        self.status, self.retry_after = status, retry_after


class _Backoff(wait_base):
    """Exponential back-off with jitter, `min(max_s, initial_s * 2 ** (attempt - 1) + uniform(0,
    jitter_s))` (0.2, 0.4, 0.8, ... s plus jitter by default), or the answer's Retry-After when
    that is longer (capped at `max_retry_after_s`)."""

    def __init__(self, initial_s: float, max_s: float, jitter_s: float, max_retry_after_s: float):
        self.initial_s, self.max_s, self.jitter_s = initial_s, max_s, jitter_s
        self.max_retry_after_s = max_retry_after_s

    def __call__(self, retry_state: RetryCallState) -> float:
        exponent = min(retry_state.attempt_number - 1, 64)
        delay = min(self.max_s, self.initial_s * 2 ** exponent + random.uniform(0, self.jitter_s))
        error = retry_state.outcome.exception() if retry_state.outcome is not None else None
        retry_after = getattr(error, "retry_after", None)
        return delay if retry_after is None else max(delay, min(retry_after, self.max_retry_after_s))


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _with_event_id(record: RecordLike, where: str = "") -> FeedbackRecord:
    rec = to_record(record, where)
    return rec if rec.event_id else rec.model_copy(update={"event_id": new_event_id()})


def _dump(rec: FeedbackRecord) -> bytes:
    return _encode(rec.model_dump(mode="json", exclude_none=True))


def _retry_after(r: httpx.Response) -> float | None:
    value = r.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def _envelope(r: httpx.Response) -> tuple[str | None, str, str | None]:
    """(code, message, field) of the webhook's `{"error": {...}}`, or the body's text."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):
        return None, r.text[:500] or r.reason_phrase, None
    return err.get("code"), str(err.get("message") or r.text[:500]), err.get("field")


class _Core:
    """What the sync and async clients share: settings, request building, answers to errors."""

    def __init__(self, base_url: str, api_key: str, *, signing_secret: str | None = None, timeout_s: float = 10.0,
                 max_attempts: int = 6, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 jitter_s: float | None = None, max_retry_after_s: float = 60.0, batch_size: int = MAX_BATCH,
                 max_body_bytes: int = MAX_BODY_BYTES):
        if max_attempts < 1 or batch_size < 1:
            raise ValueError(f"max_attempts ({max_attempts}) and batch_size ({batch_size}) must be >= 1")
        if not api_key:
            raise ValueError("api_key is required: the tenant's API key")
        self.base_url = base_url.rstrip("/")
        self.signing_secret = signing_secret
        self.timeout_s, self.max_attempts, self.batch_size = timeout_s, max_attempts, batch_size
        self.max_body_bytes = max_body_bytes
        self._backoff = _Backoff(backoff_s, max_backoff_s, backoff_s if jitter_s is None else jitter_s,
                                 max_retry_after_s)
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
                         "User-Agent": f"clora-client/{__version__}"}

    # --- requests ---------------------------------------------------------------------------

    def _one(self, record: RecordLike) -> _Request:
        rec = _with_event_id(record)
        return _Request("/v1/feedback", _dump(rec), [rec.event_id])

    def _batches(self, records: Iterable[RecordLike]) -> list[_Request]:
        """The records, each validated and named first, packed into requests within the limits."""
        encoded = []
        for i, record in enumerate(records):
            rec = _with_event_id(record, f"records.{i}")
            encoded.append((rec.event_id, _dump(rec)))
        out, ids, parts, size = [], [], [], _ENVELOPE
        for event_id, body in encoded:
            if parts and (len(parts) >= self.batch_size or size + 1 + len(body) > self.max_body_bytes):
                out.append(_Request("/v1/feedback/batch", b'{"records":[' + b",".join(parts) + b"]}", ids))
                ids, parts, size = [], [], _ENVELOPE
            size += len(body) + (1 if parts else 0)
            ids.append(event_id)
            parts.append(body)
        if parts:
            out.append(_Request("/v1/feedback/batch", b'{"records":[' + b",".join(parts) + b"]}", ids))
        return out

    def _signed(self, body: bytes) -> dict[str, str]:
        if self.signing_secret is None:
            return self._headers
        return {**self._headers, **signature_headers(self.signing_secret, body)}

    def _retrying(self) -> dict[str, Any]:
        return dict(stop=stop_after_attempt(self.max_attempts), wait=self._backoff, reraise=True,
                    retry=retry_if_exception_type((httpx.TransportError, _RetryableAnswer)))

    # --- answers ----------------------------------------------------------------------------

    def _check(self, r: httpx.Response, req: _Request, accepted: list[str]) -> None:
        if 200 <= r.status_code < 300:
            return
        code, message, field = _envelope(r)
        if r.status_code == 429 or r.status_code >= 500:
            raise _RetryableAnswer(r.status_code, message, _retry_after(r))
        error = AuthenticationError if r.status_code in (401, 403) else FeedbackRejected
        raise error(r.status_code, code, message, field, req.event_ids, accepted)

    def _unavailable(self, e: Exception, req: _Request, accepted: list[str]) -> FeedbackUnavailable:
        last = str(e) if isinstance(e, _RetryableAnswer) else f"{type(e).__name__}: {e}"
        return FeedbackUnavailable(f"POST {self.base_url}{req.path} with {len(req.event_ids)} record(s) failed "
                                   f"{self.max_attempts} times; last: {last}", req.event_ids, accepted,
                                   status=getattr(e, "status", None))

    # --- the usual kinds of feedback (`clora_client.records`), through each client's `send` -

    def thumbs(self, interaction: Any, up: bool, **kw: Any):
        """Send a thumbs-up or -down (`records.thumbs`); returns its event id."""
        return self.send(build.thumbs(interaction, up, **kw))

    def rating(self, interaction: Any, value: int, **kw: Any):
        """Send a rating (`records.rating`); returns its event id."""
        return self.send(build.rating(interaction, value, **kw))

    def reward(self, interaction: Any, value: float, **kw: Any):
        """Send a reward (`records.reward`); returns its event id."""
        return self.send(build.reward(interaction, value, **kw))

    def correction(self, interaction: Any, answer: Any, **kw: Any):
        """Send the answer as it should have been (`records.correction`); returns its event id."""
        return self.send(build.correction(interaction, answer, **kw))

    def preference(self, interaction: Any, chosen: Any, **kw: Any):
        """Send an answer preferred to the one served (`records.preference`); returns its event id."""
        return self.send(build.preference(interaction, chosen, **kw))

    def comment(self, interaction: Any, text: str, **kw: Any):
        """Send a comment (`records.comment`); returns its event id."""
        return self.send(build.comment(interaction, text, **kw))


class FeedbackClient(_Core):
    """Sends one tenant's feedback; thread-safe. `transport` and `sleep` are for tests."""

    def __init__(self, base_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep, **settings: Any):
        super().__init__(base_url, api_key, **settings)
        self._sleep = sleep
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout_s, transport=transport)

    def __enter__(self) -> "FeedbackClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, record: RecordLike) -> str:
        """Send one record; returns its event id once the webhook stored it."""
        req = self._one(record)
        self._post(req, [])
        return req.event_ids[0]

    def send_batch(self, records: Iterable[RecordLike]) -> list[str]:
        """Send records (validated, all of them, before the first request); returns every event
        id, in order, once all are stored."""
        accepted: list[str] = []
        for req in self._batches(records):
            self._post(req, accepted)
            accepted += req.event_ids
        return accepted

    def _post(self, req: _Request, accepted: list[str]) -> None:
        def attempt() -> None:
            self._check(self._http.post(req.path, content=req.body, headers=self._signed(req.body)), req, accepted)

        try:
            Retrying(sleep=self._sleep, **self._retrying())(attempt)
        except (httpx.TransportError, _RetryableAnswer) as e:
            raise self._unavailable(e, req, accepted) from e


class AsyncFeedbackClient(_Core):
    """`FeedbackClient` for asyncio: the same settings; `send`, `send_batch` and the helpers
    are coroutines."""

    def __init__(self, base_url: str, api_key: str, *, transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, **settings: Any):
        super().__init__(base_url, api_key, **settings)
        self._sleep = sleep
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, transport=transport)

    async def __aenter__(self) -> "AsyncFeedbackClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, record: RecordLike) -> str:
        """Send one record; returns its event id once the webhook stored it."""
        req = self._one(record)
        await self._post(req, [])
        return req.event_ids[0]

    async def send_batch(self, records: Iterable[RecordLike]) -> list[str]:
        """Send records (validated, all of them, before the first request); returns every event
        id, in order, once all are stored."""
        accepted: list[str] = []
        for req in self._batches(records):
            await self._post(req, accepted)
            accepted += req.event_ids
        return accepted

    async def _post(self, req: _Request, accepted: list[str]) -> None:
        async def attempt() -> None:
            r = await self._http.post(req.path, content=req.body, headers=self._signed(req.body))
            self._check(r, req, accepted)

        try:
            await AsyncRetrying(sleep=self._sleep, **self._retrying())(attempt)
        except (httpx.TransportError, _RetryableAnswer) as e:
            raise self._unavailable(e, req, accepted) from e

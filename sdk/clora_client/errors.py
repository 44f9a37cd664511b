"""What can go wrong sending feedback, as one family under `ClientError`:

| exception             | when                                                                 |
|-----------------------|----------------------------------------------------------------------|
| `InvalidFeedback`     | a record the webhook would refuse; caught before anything is sent    |
| `FeedbackRejected`    | the webhook answered a 4xx other than 429 (not retried)              |
| `AuthenticationError` | its 401 (key or signature) or 403 (an interaction of another tenant) |
| `FeedbackUnavailable` | every attempt met a broken connection, a 429 or a 5xx                |

`FeedbackRejected` carries the webhook's error envelope, `{"error": {code, message, field}}`,
as `status`, `code`, `message` and `field`. Every error names the records it concerns by their
`event_ids`; `accepted` lists the ids of earlier batches of the same call that were stored.
"""

from __future__ import annotations

import re

_RECORD_FIELD = re.compile(r"records\.([0-9]+)(?:\.|$)")


class ClientError(RuntimeError):
    """Feedback could not be delivered (the base of every error this SDK raises)."""

    def __init__(self, message: str, event_ids: list[str] | None = None, accepted: list[str] | None = None):
        super().__init__(message)
        self.event_ids: list[str] = list(event_ids or [])
        """The records this error is about (one request's worth)."""
        self.accepted: list[str] = list(accepted or [])
        """Event ids stored by earlier requests of the same `send_batch` call."""


class InvalidFeedback(ClientError, ValueError):
    """A record fails the webhook's own validation; nothing was sent. `field` names where
    (`records.3.score` within a batch)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class FeedbackRejected(ClientError):
    """The webhook refused a request with a 4xx that retrying would not change."""

    def __init__(self, status: int, code: str | None, message: str, field: str | None, event_ids: list[str],
                 accepted: list[str] | None = None):
        shown = f"{event_ids[:3]}{'...' if len(event_ids) > 3 else ''}"
        where = f" (field {field})" if field else ""
        super().__init__(f"webhook rejected {len(event_ids)} feedback record(s) {shown} with {status} "
                         f"{code or 'error'}: {message}{where}", event_ids, accepted)
        self.status, self.code, self.message, self.field = status, code, message, field

    @property
    def rejected_event_id(self) -> str | None:
        """The event id of the record `field` points into (`records.3.score` -> the 4th record's),
        or the only record's; None when the error is about the request as a whole."""
        m = _RECORD_FIELD.match(self.field or "")
        if m is not None and int(m[1]) < len(self.event_ids):
            return self.event_ids[int(m[1])]
        return self.event_ids[0] if len(self.event_ids) == 1 else None


class AuthenticationError(FeedbackRejected):
    """401: a missing, unknown or revoked API key, or a missing, bad or stale signature.
    403: feedback on an interaction that was served to another tenant."""


class FeedbackUnavailable(ClientError):
    """The webhook stayed unreachable, over quota (429) or failing (5xx) through every attempt.
    Nothing in `event_ids` is known to be stored; resending them is safe (the ids dedup)."""

    def __init__(self, message: str, event_ids: list[str], accepted: list[str] | None = None,
                 status: int | None = None):
        super().__init__(message, event_ids, accepted)
        self.status = status
        """The last answer's status; None when the last attempt got no answer."""

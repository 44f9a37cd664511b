"""Request signing, for tenants that have a signing secret.

The webhook then requires, on every request,

    X-Clora-Timestamp: <unix seconds>
    X-Clora-Signature: sha256=<hex HMAC-SHA256, keyed by the secret, of "{timestamp}." + body>

with the timestamp within its replay window (5 minutes by default). The client signs each
attempt afresh, so a retry after a long back-off is not stale.
"""

from __future__ import annotations

import hashlib
import hmac
import time

TIMESTAMP_HEADER = "X-Clora-Timestamp"
SIGNATURE_HEADER = "X-Clora-Signature"


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of `"{timestamp}." + body` keyed by `secret`."""
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def signature_headers(secret: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The two headers that sign `body` at `now` (default: the current time)."""
    timestamp = str(int(time.time() if now is None else now))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: "sha256=" + sign(secret, timestamp, body)}

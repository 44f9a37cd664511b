"""The feedback webhook client the platform's agents use: the tenant SDK's (`clora_client`),
re-exported under the names platform code has always imported from here.

The agents send feedback the way a tenant does, through the same client: `FeedbackClient`
batches records within the webhook's limits, names each with a client-side event id before its
first send, signs when given a signing secret, and retries broken connections, 429s and 5xxs
with the same event ids (the platform stores each once). `send` takes the SDK's
`FeedbackRecord`, a dict, or the platform's own `clora.ingest.schemas.FeedbackIn`.
"""

from __future__ import annotations

from clora_client import (AsyncFeedbackClient, AuthenticationError, ClientError, FeedbackClient, FeedbackRecord,
                          FeedbackRejected, FeedbackUnavailable, InvalidFeedback, interaction_id, interaction_ids)

FeedbackError = ClientError
"""The base of every feedback error (the SDK's `ClientError`)."""

__all__ = ["AsyncFeedbackClient", "AuthenticationError", "ClientError", "FeedbackClient", "FeedbackError",
           "FeedbackRecord", "FeedbackRejected", "FeedbackUnavailable", "InvalidFeedback", "interaction_id",
           "interaction_ids"]

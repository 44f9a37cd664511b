"""clora_client — the tenant SDK of clora: feedback on what the gateway served, to the webhook.

    from clora_client import FeedbackClient, interaction_id

    with FeedbackClient("https://webhook.example", "<tenant API key>") as feedback:
        feedback.thumbs(completion, up=True)                  # an openai ChatCompletion
        feedback.correction(interaction_id(completion, 1), "4")  # choice 1 of an n=2 response

| module     | owns |
|------------|------|
| `client`   | `FeedbackClient`, `AsyncFeedbackClient`: batching, signing, retries with the same event ids |
| `models`   | `FeedbackRecord`, `Message`: exactly the records the webhook accepts |
| `records`  | builders: `thumbs`, `rating`, `reward`, `correction`, `preference`, `comment` |
| `ids`      | `interaction_id` from the `openai` client's responses; `new_event_id` |
| `signing`  | the HMAC-SHA256 request signature (`X-Clora-Timestamp`, `X-Clora-Signature`) |
| `errors`   | `ClientError` and its kinds: `InvalidFeedback`, `FeedbackRejected`, `AuthenticationError`, `FeedbackUnavailable` |

Depends on httpx, pydantic and tenacity only.
"""

from clora_client.client import MAX_BATCH, MAX_BODY_BYTES, AsyncFeedbackClient, FeedbackClient, __version__
from clora_client.errors import (AuthenticationError, ClientError, FeedbackRejected, FeedbackUnavailable,
                                 InvalidFeedback)
from clora_client.ids import choice_ids, interaction_id, interaction_ids, new_event_id
from clora_client.models import FeedbackRecord, FeedbackSource, FunctionCall, Message, ToolCall
from clora_client.records import comment, correction, preference, rating, reward, thumbs
from clora_client.signing import sign, signature_headers

__all__ = [
    "AsyncFeedbackClient", "AuthenticationError", "ClientError", "FeedbackClient", "FeedbackRecord",
    "FeedbackRejected", "FeedbackSource", "FeedbackUnavailable", "FunctionCall", "InvalidFeedback", "MAX_BATCH",
    "MAX_BODY_BYTES", "Message", "ToolCall", "__version__", "choice_ids", "comment", "correction",
    "interaction_id", "interaction_ids", "new_event_id", "preference", "rating", "reward", "sign",
    "signature_headers", "thumbs",
]

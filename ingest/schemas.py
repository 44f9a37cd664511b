"""Event and example schemas: the contracts between gateway, webhook, workers and learner.

Events travel on Kafka as JSON, keyed by tenant id (so each tenant's events stay ordered):

| topic                | model               | produced by                         |
|----------------------|---------------------|-------------------------------------|
| `clora.interactions` | `InteractionEvent`  | the serving gateway, one per completion |
| `clora.feedback`     | `FeedbackEvent`     | the feedback webhook                |
| `clora.adapters`     | `AdapterEvent`      | the learner / control plane         |
| `clora.dlq`          | `DeadLetter`        | anyone who could not process a record |

Training examples are what ingest workers write into a tenant's replay buffer:
`SFTExample`, `PreferencePair`, `RLSample`. Every model carries `schema_version`; a
reader rejects a major version it does not know. Examples of each event are in
docs/events.md (and tests check that those examples validate).
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from clora.ids import Id, new_id, validate_tenant_id
from clora.web import MAX_JSON_DEPTH, too_deep

SCHEMA_VERSION = 1

TOPIC_INTERACTIONS = "clora.interactions"
TOPIC_FEEDBACK = "clora.feedback"
TOPIC_ADAPTERS = "clora.adapters"
TOPIC_DLQ = "clora.dlq"
ALL_TOPICS = (TOPIC_INTERACTIONS, TOPIC_FEEDBACK, TOPIC_ADAPTERS, TOPIC_DLQ)

def now() -> float:
    return time.time()


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Event(_Model):
    schema_version: Literal[1] = SCHEMA_VERSION


# --- chat messages (OpenAI shape) ---------------------------------------------------------

class FunctionCall(_Model):
    name: str = Field(max_length=256)
    """May be empty in what a model generated (a small model can emit an unnamed call), which is
    recorded as it was; a correction must name its function (`FeedbackIn`)."""
    arguments: str = Field(max_length=65_536)
    """JSON-encoded arguments, exactly as the OpenAI API carries them."""


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    """One chat message. `content` may be None for an assistant message that only calls tools."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = Field(default=None, max_length=200_000)
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=64)
    tool_call_id: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content or tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


# --- events -------------------------------------------------------------------------------

MAX_MESSAGES = 1000
"""The most messages one interaction records (the gateway refuses a longer conversation)."""


LOGPROB_FLOOR = -1e4
"""The logprob recorded for a token sampled at probability 0 (-inf from the engine)."""


class InteractionEvent(_Event):
    """One completion served by the gateway."""

    type: Literal["interaction"] = "interaction"
    event_id: Id = Field(default_factory=lambda: new_id("ev"))
    tenant: str
    interaction_id: Id
    """The response `id` the client saw; feedback refers to it."""
    time: float = Field(default_factory=now)
    adapter: str | None = None
    """Served adapter name (`acme@v7`), None for the base model."""
    adapter_version: int | None = Field(default=None, ge=0)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = None
    response: Message
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    """Sampling logprob of each completion token under the serving policy (behaviour policy)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """temperature, top_p, max_tokens, ... as requested."""
    group_id: Id | None = None
    """Rollouts of the same prompt share a group id (GRPO advantages are normalised per group)."""
    episode_id: Id | None = None
    """The agent episode a later turn continues (`metadata.episode_id`: its first turn's
    interaction id); None on a first turn, whose interaction id is the episode's."""
    latency_ms: float | None = Field(default=None, ge=0)

    _tenant = field_validator("tenant")(validate_tenant_id)

    @field_validator("completion_logprobs")
    @classmethod
    def _finite_logprobs(cls, lps: list[float] | None) -> list[float] | None:
        """A token the engine sampled at probability 0 has logprob -inf, which JSON cannot carry
        (it would arrive as null and the worker would refuse the event): it is recorded as
        `LOGPROB_FLOOR`, a probability of 0 to any float32. NaN says nothing about the policy:
        the logprobs are then dropped and the samples trained as if none were recorded."""
        # A NaN or an infinity makes the sum one: summed in C, not a Python step per token. Only
        # a sum that overflowed (or a non-finite value) checks token by token.
        if lps is None or math.isfinite(sum(lps)) or all(math.isfinite(x) for x in lps):
            return lps
        if any(math.isnan(x) or x == math.inf for x in lps):
            return None
        return [x if math.isfinite(x) else LOGPROB_FLOOR for x in lps]

    @model_validator(mode="after")
    def _aligned(self) -> "InteractionEvent":
        if self.response.role != "assistant":
            raise ValueError("response must be an assistant message")
        ids, lps = self.completion_token_ids, self.completion_logprobs
        if lps is not None and (ids is None or len(ids) != len(lps)):
            raise ValueError("completion_logprobs must align one-to-one with completion_token_ids")
        return self


FeedbackSource = Literal["user", "operator", "environment", "judge"]


def _field_error(model: str, loc: tuple[str | int, ...], code: str, message: str, value: Any) -> ValidationError:
    """A validation error at `loc` inside the model being validated (pydantic prefixes the
    outer path), so that the webhook's 422 names the exact field."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(
        type=PydanticCustomError(code, message), loc=loc, input=value)])


class FeedbackIn(_Model):
    """A feedback record as a client sends it to `POST /v1/feedback`.

    Field names follow LangSmith's feedback records (`key`, `score`, `comment`,
    `correction`, `feedback_source`→`source`) so existing tooling maps onto it. Every number is
    finite (NaN and ±Infinity are refused), and a correction's tool-call `arguments` nest at
    most `MAX_JSON_DEPTH` levels.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    interaction_id: Id
    """The `id` of the chat completion this feedback is about."""
    event_id: Id | None = None
    """Client-chosen id for idempotent retries; the server assigns one when absent."""
    source: FeedbackSource = "user"
    score: float | None = Field(default=None, ge=-1e6, le=1e6, allow_inf_nan=False)
    """A reward. For RL, 1.0 = correct; any real number is accepted."""
    correction: Message | None = None
    """The assistant message as it should have been (role must be assistant)."""
    comment: str | None = Field(default=None, max_length=10_000)
    key: str | None = Field(default=None, max_length=128)
    """What was judged: "correctness", "helpfulness", ..."""
    time: float | None = None
    """When the feedback was given (unix seconds); default: when the webhook accepted it."""

    @model_validator(mode="after")
    def _useful(self) -> "FeedbackIn":
        if self.score is None and self.correction is None and self.comment is None:
            raise ValueError("feedback needs at least one of score, correction, comment")
        if self.correction is not None and self.correction.role != "assistant":
            raise ValueError("correction must be an assistant message")
        calls = (self.correction.tool_calls or []) if self.correction is not None else []
        for i, call in enumerate(calls):
            at = ("correction", "tool_calls", i, "function")
            if not call.function.name:
                raise _field_error("FeedbackIn", (*at, "name"), "unnamed_function",
                                   "a correction must name the function it calls", call.function.name)
            if too_deep(call.function.arguments) is not None:
                raise _field_error("FeedbackIn", (*at, "arguments"), "too_deeply_nested",
                                   f"nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                                   call.function.arguments[:100])
        return self


class FeedbackBatchIn(_Model):
    records: list[FeedbackIn] = Field(min_length=1)


class FeedbackEvent(_Event):
    """A feedback record accepted by the webhook, as it travels on `clora.feedback`. Its numbers
    are finite, as `FeedbackIn`'s are."""

    model_config = ConfigDict(allow_inf_nan=False)

    type: Literal["feedback"] = "feedback"
    event_id: Id
    tenant: str
    interaction_id: Id
    time: float
    source: FeedbackSource
    score: float | None = None
    correction: Message | None = None
    comment: str | None = None
    key: str | None = None
    accepted_at: float | None = None
    """When the webhook accepted the record, by the webhook's clock (unix seconds): after every
    check, just before the broker write its 202 waits for. `time` is the client's claim; this is
    the server's, and where freshness (feedback -> served) starts (`clora.freshness`). None on
    events from before it was recorded."""

    _tenant = field_validator("tenant")(validate_tenant_id)

    @classmethod
    def accept(cls, tenant: str, record: FeedbackIn, event_id: str | None = None) -> "FeedbackEvent":
        """The event for `record`, accepted now; `event_id` names it when the client sent none
        (default: a fresh id)."""
        accepted = now()
        return cls(
            event_id=record.event_id or event_id or new_id("fb"), tenant=tenant,
            interaction_id=record.interaction_id, time=record.time if record.time is not None else accepted,
            source=record.source, score=record.score, correction=record.correction,
            comment=record.comment, key=record.key, accepted_at=accepted,
        )


class AdapterEvent(_Event):
    """A tenant's adapter version was published, promoted or rolled back."""

    type: Literal["adapter"] = "adapter"
    event_id: Id = Field(default_factory=lambda: new_id("ad"))
    tenant: str
    action: Literal["published", "promoted", "rolled_back"]
    version: int = Field(ge=0)
    path: str
    """Folder holding adapter_config.json + adapter_model.safetensors for this version."""
    base_model: str
    parent_version: int | None = None
    time: float = Field(default_factory=now)
    metrics: dict[str, float] = Field(default_factory=dict)

    _tenant = field_validator("tenant")(validate_tenant_id)


class DeadLetter(_Event):
    """A record that failed validation or processing, with the reason. Never silently dropped."""

    type: Literal["dead_letter"] = "dead_letter"
    event_id: Id = Field(default_factory=lambda: new_id("dl"))
    source_topic: str
    source_partition: int | None = None
    source_offset: int | None = None
    key: str | None = None
    reason: str
    payload: str
    """The original record value, decoded as UTF-8 (with replacement)."""
    time: float = Field(default_factory=now)


# --- training examples (replay buffers) ---------------------------------------------------

class _Example(_Model):
    example_id: str
    """Derived from the feedback event id, so a redelivered event maps to the same example."""
    tenant: str
    interaction_id: str
    feedback_event_id: str
    adapter_version: int | None = None
    """Version that produced the original answer (lineage)."""
    time: float
    accepted_at: float | None = None
    """When the webhook accepted the feedback event (its `accepted_at`): the learner records it
    in the lineage of the version that first trains on this example. None on examples from
    before it was recorded."""


class SFTExample(_Example):
    kind: Literal["sft"] = "sft"
    messages: list[Message]
    """The prompt: every message before the answer."""
    tools: list[dict[str, Any]] | None = None
    target: Message
    """The assistant message to learn (an operator's correction)."""


class PreferencePair(_Example):
    kind: Literal["preference"] = "preference"
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    chosen: Message
    rejected: Message


class RLSample(_Example):
    kind: Literal["rl"] = "rl"
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    response: Message
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    behaviour_logprobs: list[float] | None = None
    reward: float
    group_id: str
    episode_id: str | None = None
    """The episode this turn belongs to; the reward tally counts an episode once (None: the
    sample counts alone, as samples stored before episodes were recorded do)."""
    weight: float = Field(default=1.0, gt=0)
    """How much this sample counts in training, relative to others: its feedback key's weight in
    the tenant's reward spec (`clora.reward_spec`), 1.0 without a spec. A thumbs-up key of
    weight 0.5 makes a sample half as loud as one of weight 1."""


Example = Annotated[SFTExample | PreferencePair | RLSample, Field(discriminator="kind")]
EXAMPLE_KINDS = ("sft", "preference", "rl")

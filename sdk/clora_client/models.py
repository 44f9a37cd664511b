"""The feedback record, typed: `FeedbackRecord` and the chat `Message` a correction carries.

They accept exactly what the webhook accepts (`clora.ingest.schemas.FeedbackIn`; the platform's
test suite checks both against one corpus of valid and invalid records), so a record that fails
here would have been a 422, and one that passes is refused only for who sent it (401/403) or
how much (413/429):

    {"interaction_id": "chatcmpl-1", "source": "user", "key": "thumbs", "score": 1}
    {"interaction_id": "chatcmpl-1-2", "source": "operator",
     "correction": {"role": "assistant", "content": "4"}}

A record needs at least one of `score`, `correction`, `comment`. Numbers are finite; a
correction is an assistant message whose tool calls name their function, with `arguments`
nested at most `MAX_JSON_DEPTH` levels.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Mapping
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from clora_client.errors import InvalidFeedback

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects the webhook takes, in a body or in a tool call's
JSON `arguments`."""

Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]
"""An interaction or event id: 1-128 of A-Z, a-z, 0-9, `_ . : @ -`."""

FeedbackSource = Literal["user", "operator", "environment", "judge"]
"""Who gave the feedback; a tenant's reward spec says which sources each key trusts."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionCall(_Model):
    name: str = Field(max_length=256)
    arguments: str = Field(max_length=65_536)
    """JSON-encoded arguments, exactly as the OpenAI API carries them."""


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    """One chat message (OpenAI's shape). `content` may be None for an assistant message that
    only calls tools."""

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


class FeedbackRecord(_Model):
    """One feedback record, as `POST /v1/feedback` takes it. Field names follow LangSmith's
    feedback records (`key`, `score`, `comment`, `correction`)."""

    model_config = ConfigDict(allow_inf_nan=False)

    interaction_id: Id
    """The interaction this feedback is about: a response's `id`, or `{id}-{index}` for one
    choice of a response with n > 1 (`clora_client.interaction_id`)."""
    event_id: Id | None = None
    """Names the record for idempotent retries; the client fills in a fresh one when absent."""
    source: FeedbackSource = "user"
    score: float | None = Field(default=None, ge=-1e6, le=1e6, allow_inf_nan=False)
    """A reward, or the value of `key` (a thumb 0/1, a rating); its meaning is the tenant's
    reward spec's."""
    correction: Message | None = None
    """The assistant message as it should have been."""
    comment: str | None = Field(default=None, max_length=10_000)
    key: str | None = Field(default=None, max_length=128)
    """What was judged: "thumbs", "correctness", "helpfulness", ..."""
    time: float | None = None
    """When the feedback was given (unix seconds); default: when the webhook accepted it."""

    @model_validator(mode="after")
    def _useful(self) -> "FeedbackRecord":
        if self.score is None and self.correction is None and self.comment is None:
            raise ValueError("feedback needs at least one of score, correction, comment")
        if self.correction is not None and self.correction.role != "assistant":
            raise ValueError("correction must be an assistant message")
        calls = (self.correction.tool_calls or []) if self.correction is not None else []
        for i, call in enumerate(calls):
            at = ("correction", "tool_calls", i, "function")
            if not call.function.name:
                raise _field_error((*at, "name"), "unnamed_function",
                                   "a correction must name the function it calls", call.function.name)
            if too_deep(call.function.arguments):
                raise _field_error((*at, "arguments"), "too_deeply_nested",
                                   f"nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                                   call.function.arguments[:100])
        return self


def _field_error(loc: tuple[str | int, ...], code: str, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("FeedbackRecord", [InitErrorDetails(
        type=PydanticCustomError(code, message), loc=loc, input=value)])


_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(text: str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `text` (JSON, or JSON-like) nests arrays and objects deeper than `max_depth`,
    counted as the webhook counts: brackets inside strings do not count, and counting stops at a
    closing bracket with nothing open."""
    steps = array("b", _STRINGS.sub(b"", text.encode()).translate(_STEP, _NOT_BRACKETS))
    if not steps or max(accumulate(steps)) <= max_depth:
        return False
    levels = list(accumulate(steps))
    crossed = levels.index(max_depth + 1)
    return not (crossed and min(levels[:crossed]) < 0)


RecordLike = FeedbackRecord | Mapping[str, Any] | BaseModel
"""What `send` takes: a `FeedbackRecord`, a dict of its fields, or another pydantic model with
the same fields (the platform's own `FeedbackIn`)."""


def to_record(record: RecordLike, where: str = "") -> FeedbackRecord:
    """`record` as a `FeedbackRecord`, or `InvalidFeedback` naming the first wrong field (within
    `where`, e.g. `records.3`)."""
    if isinstance(record, FeedbackRecord):
        return record
    data = record.model_dump(exclude_none=True) if isinstance(record, BaseModel) else record
    try:
        return FeedbackRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in ((where,) if where else ()) + tuple(first["loc"])) or where or "record"
        raise InvalidFeedback(f"{field}: {first['msg']}", field) from e

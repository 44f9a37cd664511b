"""Event schemas (clora.ingest.schemas): the documented examples validate, and bad records are
refused naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from clora.ingest import schemas

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def documented_examples() -> list[tuple[str, dict]]:
    text = DOC.read_text()
    found = re.findall(r"### (\w+)\n(?:.*?\n)*?```json\n(.*?)```", text, flags=re.S)
    return [(name, json.loads(body)) for name, body in found]


def test_every_documented_event_validates():
    examples = documented_examples()
    assert {n for n, _ in examples} == {"FeedbackIn", "InteractionEvent", "FeedbackEvent", "AdapterEvent", "DeadLetter"}
    for name, body in examples:
        getattr(schemas, name).model_validate(body)


def _ix(**kw) -> schemas.InteractionEvent:
    base = dict(tenant="acme", interaction_id="i1", messages=[{"role": "user", "content": "2+2?"}],
                response={"role": "assistant", "content": "5"}, completion_token_ids=[1, 2],
                completion_logprobs=[-0.1, -0.2], group_id="g1", adapter_version=3)
    return schemas.InteractionEvent.model_validate({**base, **kw})


@pytest.mark.parametrize("body, field", [
    ({"interaction_id": "i1"}, "feedback needs at least one"),
    ({"interaction_id": "i1", "score": "high"}, "score"),
    ({"interaction_id": "i1", "score": float("nan")}, "score"),
    ({"interaction_id": "i1", "source": "robot", "score": 1}, "source"),
    ({"interaction_id": "has space", "score": 1}, "interaction_id"),
    ({"interaction_id": "i1", "correction": {"role": "user", "content": "x"}}, "assistant"),
    ({"interaction_id": "i1", "score": 1, "extra": 1}, "extra"),
    ({"interaction_id": "i1", "correction": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}]}},
     r"correction.tool_calls.0.function.name"),   # a correction teaches: it must name its function
])
def test_bad_feedback_names_the_problem(body, field):
    with pytest.raises(ValidationError, match=field):
        schemas.FeedbackIn.model_validate(body)


def test_logprobs_must_align_with_tokens():
    with pytest.raises(ValidationError, match="align"):
        _ix(completion_logprobs=[-0.1])

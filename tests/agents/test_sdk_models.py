"""The tenant SDK's records (`clora_client.FeedbackRecord`) accept exactly what the webhook's
(`clora.ingest.schemas.FeedbackIn`, `FeedbackBatchIn`) accept: one corpus of valid and invalid
records, each validated by both, must get the same verdict; and what the SDK sends of a valid
record validates on the webhook's side to the same record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from clora.ingest.schemas import FeedbackBatchIn, FeedbackIn
from clora.web import MAX_JSON_DEPTH
from clora_client import FeedbackRecord, InvalidFeedback, records
from clora_client.client import FeedbackClient

IID = "chatcmpl-1"


def call(name: str = "lookup", arguments: str = "{}", **kw) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}, **kw}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


VALID = {
    "score": {"interaction_id": IID, "score": 1.0},
    "int score": {"interaction_id": IID, "score": 4},
    "numeric string score": {"interaction_id": IID, "score": "0.5"},
    "score at the bounds": {"interaction_id": IID, "score": -1e6},
    "comment only": {"interaction_id": IID, "comment": "fine"},
    "every field": {"interaction_id": "chatcmpl-1-2", "event_id": "fb-x:1@a.b", "source": "judge", "score": 0.0,
                    "correction": {"role": "assistant", "content": "4", "name": "bot"}, "comment": "c",
                    "key": "exact", "time": 1700000000.5},
    "correction only": {"interaction_id": IID, "correction": {"role": "assistant", "content": "4"}},
    "correction with tool calls": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [call(arguments='{"q": "[[[["}')]}},
    "arguments at the depth limit": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [call(arguments=nested(MAX_JSON_DEPTH))]}},
    "arguments that are not JSON": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [call(arguments="]" + nested(MAX_JSON_DEPTH + 5))]}},
    "id of 128 characters": {"interaction_id": "a" * 128, "score": 1},
    "empty comment": {"interaction_id": IID, "comment": ""},
    "source operator": {"interaction_id": IID, "source": "operator", "score": 1},
    "source environment": {"interaction_id": IID, "source": "environment", "score": 1},
    "comment at its limit": {"interaction_id": IID, "comment": "x" * 10_000},
    "key at its limit": {"interaction_id": IID, "key": "k" * 128, "score": 1},
    "bool score": {"interaction_id": IID, "score": True},
}

INVALID = {
    "nothing to say": {"interaction_id": IID},
    "no interaction": {"score": 1},
    "empty interaction id": {"interaction_id": "", "score": 1},
    "id with a space": {"interaction_id": "chat cmpl", "score": 1},
    "id with a final newline": {"interaction_id": "chatcmpl-1\n", "score": 1},
    "id too long": {"interaction_id": "a" * 129, "score": 1},
    "bad event id": {"interaction_id": IID, "event_id": "a/b", "score": 1},
    "unknown field": {"interaction_id": IID, "score": 1, "rating": 5},
    "unknown source": {"interaction_id": IID, "source": "robot", "score": 1},
    "nan score": {"interaction_id": IID, "score": float("nan")},
    "infinite score": {"interaction_id": IID, "score": float("inf")},
    "score too big": {"interaction_id": IID, "score": 1e6 + 1},
    "infinite time": {"interaction_id": IID, "score": 1, "time": float("inf")},
    "text score": {"interaction_id": IID, "score": "high"},
    "comment too long": {"interaction_id": IID, "comment": "x" * 10_001},
    "key too long": {"interaction_id": IID, "key": "k" * 129, "score": 1},
    "lone surrogate": {"interaction_id": IID, "comment": "\ud800"},
    "user correction": {"interaction_id": IID, "correction": {"role": "user", "content": "4"}},
    "empty correction": {"interaction_id": IID, "correction": {"role": "assistant"}},
    "correction with an unknown role": {"interaction_id": IID, "correction": {"role": "bot", "content": "4"}},
    "correction with an extra field": {"interaction_id": IID, "correction": {"role": "assistant", "content": "4",
                                                                             "refusal": None}},
    "unnamed function": {"interaction_id": IID, "correction": {"role": "assistant", "tool_calls": [call(name="")]}},
    "arguments nested too deep": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [call(arguments=nested(MAX_JSON_DEPTH + 1))]}},
    "tool call of another type": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [call(type="retrieval")]}},
    "tool call without an id": {"interaction_id": IID, "correction": {
        "role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}},
    "tool calls on a tool message": {"interaction_id": IID, "correction": {
        "role": "tool", "content": "x", "tool_calls": [call()]}},
    "too many tool calls": {"interaction_id": IID, "correction": {"role": "assistant", "tool_calls": [call()] * 65}},
    "content too long": {"interaction_id": IID, "correction": {"role": "assistant", "content": "x" * 200_001}},
    "not an object": ["chatcmpl-1", 1.0],
}


def verdict(model, data) -> bool:
    try:
        model.model_validate(data)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(VALID))
def test_a_record_the_webhook_accepts_the_sdk_accepts_and_sends_unchanged(name):
    data = VALID[name]
    theirs, ours = FeedbackIn.model_validate(data), FeedbackRecord.model_validate(data)
    sent = json.loads(json.dumps(ours.model_dump(mode="json", exclude_none=True)))
    assert FeedbackIn.model_validate(sent) == theirs
    assert FeedbackBatchIn.model_validate({"records": [sent, sent]}).records == [theirs, theirs]


@pytest.mark.parametrize("name", sorted(INVALID))
def test_a_record_the_webhook_refuses_the_sdk_refuses(name):
    data = INVALID[name]
    assert not verdict(FeedbackIn, data), f"the corpus says {name!r} is invalid, but the webhook takes it"
    assert not verdict(FeedbackRecord, data), f"the SDK takes {name!r}, which the webhook refuses"
    assert not verdict(FeedbackBatchIn, {"records": [VALID["score"], data]})


def test_the_sdk_names_the_same_field_the_webhook_does():
    for data in ({"interaction_id": IID, "score": float("nan")},
                 {"interaction_id": IID, "correction": {"role": "assistant", "tool_calls": [call(name="")]}},
                 {"interaction_id": IID, "correction": {"role": "assistant",
                                                        "tool_calls": [call(arguments=nested(99))]}}):
        with pytest.raises(ValidationError) as theirs:
            FeedbackIn.model_validate(data)
        with pytest.raises(ValidationError) as ours:
            FeedbackRecord.model_validate(data)
        assert [e["loc"] for e in ours.value.errors()] == [e["loc"] for e in theirs.value.errors()]


def test_the_sdk_and_the_webhook_have_the_same_fields():
    assert FeedbackRecord.model_fields.keys() == FeedbackIn.model_fields.keys()


def test_every_builder_makes_a_record_the_webhook_accepts():
    made = [records.thumbs(IID, True), records.rating(IID, 5), records.reward(IID, 0.25, key="exact"),
            records.correction(IID, "4"), records.preference(IID, "four"), records.comment(IID, "ok")]
    for rec in made:
        FeedbackIn.model_validate(rec.model_dump(mode="json", exclude_none=True))


def test_the_platform_feedback_in_is_sent_as_it_is(fake_webhook):
    rec = FeedbackIn(interaction_id=IID, event_id="env-1", source="operator", score=0.0,
                     correction={"role": "assistant", "tool_calls": [call()]})
    with FeedbackClient(fake_webhook.url, "key-1", sleep=lambda s: None) as c:
        assert c.send(rec) == "env-1"
        with pytest.raises(InvalidFeedback, match="records.1"):
            c.send_batch([rec, {"interaction_id": IID}])
    assert fake_webhook.accepted == [rec]


def test_importing_the_sdk_loads_none_of_the_platforms_heavy_dependencies():
    code = ("import sys, clora_client; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'fastapi', 'redis', 'kafka', 'openai', 'clora', 'vllm', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

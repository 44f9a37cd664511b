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


@pytest.mark.parametrize("time", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("model", [schemas.FeedbackIn, schemas.FeedbackEvent])
def test_feedback_times_are_finite(model, time):
    """A NaN or infinite time is refused where it comes in, naming `time`, not dead-lettered later."""
    body = {"interaction_id": "i1", "score": 1.0, "time": time}
    if model is schemas.FeedbackEvent:
        body |= {"event_id": "fb-1", "tenant": "acme", "source": "user"}
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert [err["loc"] for err in e.value.errors()] == [("time",)]
    with pytest.raises(ValidationError, match="time"):   # as JSON (Python's json reads NaN and Infinity)
        model.model_validate_json(json.dumps(body))


def _correction_calling(arguments: str) -> dict:
    return {"interaction_id": "i1", "correction": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}}


def test_correction_arguments_nest_no_deeper_than_every_reader_downstream_accepts():
    from clora.web import MAX_JSON_DEPTH

    ok = '{"a": ' * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH
    assert schemas.FeedbackIn.model_validate(_correction_calling(ok))
    deep = "[" * 30_000 + "]" * 30_000   # within the 65 536 characters `arguments` may have
    with pytest.raises(ValidationError) as e:
        schemas.FeedbackBatchIn.model_validate({"records": [_correction_calling(deep)]})
    error = e.value.errors()[0]
    assert error["loc"] == ("records", 0, "correction", "tool_calls", 0, "function", "arguments")
    assert error["type"] == "too_deeply_nested" and f"deeper than {MAX_JSON_DEPTH}" in error["msg"]


def test_an_unnamed_correction_call_names_its_exact_field():
    body = _correction_calling("{}")
    body["correction"]["tool_calls"][0]["function"]["name"] = ""
    with pytest.raises(ValidationError) as e:
        schemas.FeedbackIn.model_validate(body)
    assert e.value.errors()[0]["loc"] == ("correction", "tool_calls", 0, "function", "name")


def test_accept_names_an_event_by_the_clients_id_else_the_given_one_else_a_fresh_one():
    rec = schemas.FeedbackIn(interaction_id="i1", score=1.0, time=0.0)
    assert schemas.FeedbackEvent.accept("acme", rec, "fb-derived").event_id == "fb-derived"
    assert schemas.FeedbackEvent.accept("acme", rec.model_copy(update={"event_id": "mine"}), "fb-d").event_id == "mine"
    assert schemas.FeedbackEvent.accept("acme", rec).event_id.startswith("fb-")
    assert schemas.FeedbackEvent.accept("acme", rec).time == 0.0   # a time of 0 is a time, not "absent"


def test_an_interactions_non_finite_logprobs_survive_its_trip_through_json():
    from clora.ingest.schemas import LOGPROB_FLOOR, InteractionEvent, Message

    def event(lps):
        return InteractionEvent(tenant="acme", interaction_id="chatcmpl-1", messages=[Message(role="user", content="hi")],
                                response=Message(role="assistant", content="ok"), completion_token_ids=[1, 2, 3],
                                completion_logprobs=lps)

    floored = InteractionEvent.model_validate_json(event([-0.5, float("-inf"), -2.0]).model_dump_json())
    assert floored.completion_logprobs == [-0.5, LOGPROB_FLOOR, -2.0]
    for bad in (float("nan"), float("inf")):
        assert InteractionEvent.model_validate_json(event([-0.5, bad, -2.0]).model_dump_json()).completion_logprobs is None
    # finite logprobs whose sum overflows are kept as they are (the validator sums them first)
    assert event([-1e308, -1e308, -1.0]).completion_logprobs == [-1e308, -1e308, -1.0]

"""The joiner (clora.ingest.joiner) builds the right training examples from an interaction and
one feedback record under the tenant's reward spec, and refuses to join across tenants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clora.reward_spec import RewardSpec
from clora.ingest import schemas
from clora.ingest.buffers import _tally, holdout_key
from clora.ingest.joiner import build_examples, join_stored, untrained_reason


def _ix(**kw) -> schemas.InteractionEvent:
    base = dict(tenant="acme", interaction_id="i1", messages=[{"role": "user", "content": "2+2?"}],
                response={"role": "assistant", "content": "5"}, completion_token_ids=[1, 2],
                completion_logprobs=[-0.1, -0.2], group_id="g1", adapter_version=3)
    return schemas.InteractionEvent.model_validate({**base, **kw})


def _fb(**kw) -> schemas.FeedbackEvent:
    rec = schemas.FeedbackIn.model_validate({"interaction_id": "i1", "event_id": "f1", **kw})
    return schemas.FeedbackEvent.accept("acme", rec)


def test_correction_gives_sft_and_preference():
    out = build_examples(_ix(), _fb(correction={"role": "assistant", "content": "4"}))
    assert [e.kind for e in out] == ["sft", "preference"]
    sft, pref = out
    assert sft.target.content == "4" and sft.messages[0].content == "2+2?"
    assert pref.chosen.content == "4" and pref.rejected.content == "5"
    assert sft.adapter_version == 3 and sft.example_id == "f1:sft"


def test_correction_equal_to_answer_gives_no_pair():
    out = build_examples(_ix(), _fb(correction={"role": "assistant", "content": "5"}))
    assert [e.kind for e in out] == ["sft"]


def test_score_gives_rl_sample_with_behaviour_logprobs():
    (rl,) = build_examples(_ix(), _fb(score=0.0, source="environment"))
    assert rl.reward == 0.0 and rl.behaviour_logprobs == [-0.1, -0.2] and rl.group_id == "g1"
    assert rl.episode_id == "i1"          # a first turn (no metadata.episode_id) starts its own episode
    (later,) = build_examples(_ix(interaction_id="i2", episode_id="i1"), _fb(interaction_id="i2", score=1.0))
    assert later.episode_id == "i1"


def test_every_example_carries_its_feedbacks_accept_time_and_old_ones_parse_without_it():
    fb = _fb(score=1.0, time=5.0, correction={"role": "assistant", "content": "4"})
    assert fb.accepted_at is not None and fb.time == 5.0          # the server's clock, apart from the client's claim
    examples = build_examples(_ix(), fb)
    assert [e.kind for e in examples] == ["sft", "preference", "rl"]
    assert {e.accepted_at for e in examples} == {fb.accepted_at}
    # an event and an example stored before accept times were recorded
    old = schemas.FeedbackEvent.model_validate_json(fb.model_dump_json(exclude={"accepted_at"}))
    assert old.accepted_at is None and build_examples(_ix(), old)[0].accepted_at is None
    stored = examples[0].model_dump(exclude={"accepted_at"})
    assert schemas.SFTExample.model_validate(stored).accepted_at is None


def test_comment_only_gives_nothing():
    assert build_examples(_ix(), _fb(comment="meh")) == []


def test_join_refuses_cross_tenant():
    with pytest.raises(ValueError, match="tenant"):
        build_examples(_ix(tenant="other"), _fb(score=1))



SPEC = RewardSpec.model_validate({"keys": {
    "thumbs": {"type": "bool", "invert": True, "sources": ["user"]},
    "stars": {"type": "scale", "lo": 1, "hi": 5, "weight": 2.5, "sources": ["user", "operator"]}}})


def test_the_reward_spec_maps_a_score_to_reward_and_weight():
    (rl,) = build_examples(_ix(), _fb(key="stars", score=4, source="operator"), SPEC)
    assert rl.reward == 0.75 and rl.weight == 2.5
    (rl,) = build_examples(_ix(), _fb(key="thumbs", score=1, source="user"), SPEC)
    assert rl.reward == 0.0 and rl.weight == 1.0          # inverted: a thumbs-up of "lower is better"
    assert untrained_reason(_fb(key="stars", score=4, source="operator"), SPEC) is None


@pytest.mark.parametrize("fb, reason", [
    (dict(key="helpfulness", score=1.0), "unknown_key"),
    (dict(score=1.0), "unknown_key"),                    # no key is "score", which this spec does not name
    (dict(key="stars", score=3, source="judge"), "untrusted_source"),
    (dict(key="stars", score=9), "out_of_range"),
    (dict(key="thumbs", score=0.5), "out_of_range"),
])
def test_a_score_the_spec_does_not_take_trains_nothing(fb, reason):
    event = _fb(**fb)
    assert build_examples(_ix(), event, SPEC) == [] and untrained_reason(event, SPEC) == reason
    assert [e.kind for e in build_examples(_ix(), event)] == ["rl"]     # without a spec it trains, as before


def test_a_refused_score_keeps_its_correction():
    event = _fb(key="helpfulness", score=0.0, correction={"role": "assistant", "content": "4"})
    assert [e.kind for e in build_examples(_ix(), event, SPEC)] == ["sft", "preference"]
    assert untrained_reason(event, SPEC) == "unknown_key"


def test_without_a_spec_a_score_trains_as_is_with_weight_one():
    (rl,) = build_examples(_ix(), _fb(key="arithmetic", score=-3.0, source="judge"))
    assert rl.reward == -3.0 and rl.weight == 1.0
    assert untrained_reason(_fb(comment="meh"), SPEC) is None            # no score: nothing to count


# --- the worker's join on the stored JSON (`join_stored`) -----------------------------------

_text = st.text(max_size=20)
_messages = st.lists(st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _text),
    st.builds(lambda c, n: {"role": "system", "content": c, "name": n}, _text, st.none() | _text),
    st.builds(lambda i, a: {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": a}}]}, st.text(min_size=1, max_size=8), _text),
    st.builds(lambda c, i: {"role": "tool", "content": c, "tool_call_id": i}, _text, _text)), min_size=1, max_size=4)
_floats = st.floats(min_value=-50, max_value=0, allow_nan=False)


@st.composite
def _stored_pairs(draw):
    n = draw(st.integers(0, 5))
    ix = _ix(interaction_id="i1", messages=draw(_messages),
             response={"role": "assistant", "content": draw(_text)},
             tools=draw(st.none() | st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}])),
             prompt_token_ids=draw(st.none() | st.lists(st.integers(0, 50_000), max_size=4)),
             completion_token_ids=draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
             completion_logprobs=draw(st.lists(_floats, min_size=n, max_size=n)),
             group_id=draw(st.none() | st.just("g7")), episode_id=draw(st.none() | st.just("e3")),
             adapter_version=draw(st.none() | st.integers(0, 9)))
    score = draw(st.one_of(st.integers(-5, 5), st.floats(-5, 5, allow_nan=False)))
    fb = _fb(score=score, key=draw(st.sampled_from([None, "stars", "thumbs"])),
             source=draw(st.sampled_from(["user", "operator", "judge"])), time=draw(st.none() | _floats))
    return ix, fb, draw(st.sampled_from([None, SPEC]))


@settings(max_examples=300, deadline=None)
@given(_stored_pairs())
def test_the_stored_json_join_makes_what_the_models_make(pair):
    """The worker's fast path gives, for every score, the examples `build_examples` gives: the
    same JSON (as data) and the same fields the buffer write reads."""
    from pydantic_core import from_json

    ix, fb, spec = pair
    fast = join_stored(ix.model_dump_json().encode(), fb, spec)
    slow = build_examples(ix, fb, spec)
    assert [e.kind for e in fast] == [e.kind for e in slow]
    for f, s in zip(fast, slow, strict=True):
        assert from_json(f.model_dump_json()) == from_json(s.model_dump_json())
        assert schemas.RLSample.model_validate_json(f.model_dump_json()) == s
        assert (_tally(f), holdout_key(f), f.example_id) == (_tally(s), holdout_key(s), s.example_id)


def test_the_stored_json_join_takes_the_models_path_for_a_correction_and_refuses_another_tenant():
    fb = _fb(score=1.0, correction={"role": "assistant", "content": "4"})
    assert join_stored(_ix().model_dump_json().encode(), fb) == build_examples(_ix(), fb)
    assert [e.kind for e in join_stored(_ix().model_dump_json().encode(), fb)] == ["sft", "preference", "rl"]
    with pytest.raises(ValueError, match="joined interaction of other"):
        join_stored(_ix(tenant="other").model_dump_json().encode(), _fb(score=1))
    assert join_stored(_ix().model_dump_json().encode(), _fb(comment="meh")) == []

"""The joiner (clora.ingest.joiner) builds the right training examples from an interaction and
one feedback record, and refuses to join across tenants."""

from __future__ import annotations

import pytest

from clora.ingest import schemas
from clora.ingest.joiner import build_examples


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


def test_comment_only_gives_nothing():
    assert build_examples(_ix(), _fb(comment="meh")) == []


def test_join_refuses_cross_tenant():
    with pytest.raises(ValueError, match="tenant"):
        build_examples(_ix(tenant="other"), _fb(score=1))


"""The reward spec (clora.reward_spec): a bad spec is refused naming the field, and a score maps
to the reward and weight its key says, or to the reason it trains nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from clora.registry import LearningPolicy
from clora.reward_spec import MAX_REWARD_KEYS, Reward, RewardSpec, Untrained, judge_score

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def spec(**keys) -> RewardSpec:
    return RewardSpec.model_validate({"keys": keys})


def thumbs(**kw) -> dict:
    return {"type": "bool", "sources": ["user"], **kw}


@pytest.mark.parametrize("keys, loc, says", [
    ({"t": thumbs(type="stars")}, ("keys", "t", "type"), "'bool', 'scale' or 'scalar'"),
    ({"h": {"type": "scale", "lo": 5, "hi": 5, "sources": ["user"]}}, ("keys", "h", "hi"), "must be above lo"),
    ({"h": {"type": "scalar", "lo": 1, "hi": 0.5, "sources": ["user"]}}, ("keys", "h", "hi"), "must be above lo"),
    ({"h": {"type": "scale", "lo": 1, "sources": ["user"]}}, ("keys", "h", "hi"), "needs both lo and hi"),
    ({"h": {"type": "scale", "lo": 0.5, "hi": 5, "sources": ["user"]}}, ("keys", "h", "lo"), "integers"),
    ({"t": thumbs(lo=0, hi=1)}, ("keys", "t", "lo"), "takes no bounds"),
    ({"t": thumbs(weight=0)}, ("keys", "t", "weight"), "greater than 0"),
    ({"t": thumbs(weight=-2)}, ("keys", "t", "weight"), "greater than 0"),
    ({"t": thumbs(sources=["robot"])}, ("keys", "t", "sources", 0), "'user', 'operator'"),
    ({"t": thumbs(sources=[])}, ("keys", "t", "sources"), "at least 1"),
    ({"t": thumbs(sources=["user", "user"])}, ("keys", "t", "sources"), "listed twice"),
    ({"t": thumbs(scale=3)}, ("keys", "t", "scale"), "Extra inputs"),
    ({"Thumbs Up": thumbs()}, ("keys", "Thumbs Up", "[key]"), "should match pattern"),
    ({"x" * 65: thumbs()}, ("keys", "x" * 65, "[key]"), "should match pattern"),
    ({f"k{i}": thumbs() for i in range(MAX_REWARD_KEYS + 1)}, ("keys",), "at most 32"),
    ({}, ("keys",), "at least 1"),
])
def test_a_bad_spec_is_refused_naming_the_field(keys, loc, says):
    with pytest.raises(ValidationError) as e:
        spec(**keys)
    first = e.value.errors()[0]
    assert first["loc"] == loc and says in first["msg"], e.value.errors()


def test_the_policy_names_the_spec_field_it_refuses():
    with pytest.raises(ValidationError) as e:
        LearningPolicy.model_validate({"reward_spec": {"keys": {"h": {"type": "scale", "lo": 3, "hi": 1,
                                                                      "sources": ["user"]}}}})
    assert e.value.errors()[0]["loc"] == ("reward_spec", "keys", "h", "hi")
    assert LearningPolicy().reward_spec is None


SPEC = spec(thumbs=thumbs(),
            stars={"type": "scale", "lo": 1, "hi": 5, "weight": 0.5, "sources": ["user", "operator"]},
            latency={"type": "scalar", "lo": 100, "hi": 300, "invert": True, "sources": ["environment"]},
            score={"type": "scalar", "lo": 0, "hi": 1, "sources": ["environment"]})


@pytest.mark.parametrize("key, source, score, verdict", [
    ("thumbs", "user", 1, Reward(1.0)),
    ("thumbs", "user", 0, Reward(0.0)),
    ("thumbs", "user", 0.5, Untrained("out_of_range")),
    ("stars", "operator", 1, Reward(0.0, 0.5)),
    ("stars", "user", 4, Reward(0.75, 0.5)),
    ("stars", "user", 5, Reward(1.0, 0.5)),
    ("stars", "user", 6, Untrained("out_of_range")),
    ("stars", "user", 0, Untrained("out_of_range")),
    ("stars", "user", 3.5, Untrained("out_of_range")),
    ("latency", "environment", 150, Reward(0.75)),       # lower is better: 1 - (150-100)/200
    ("latency", "environment", 50, Reward(1.0)),         # clipped to lo, then inverted
    ("latency", "environment", 1e5, Reward(0.0)),        # clipped to hi
    (None, "environment", 0.25, Reward(0.25)),           # no key: looked up as "score"
    ("score", "environment", 2.0, Reward(1.0)),
    ("thumbs", "judge", 1, Untrained("untrusted_source")),
    ("stars", "environment", 3, Untrained("untrusted_source")),
    (None, "user", 1.0, Untrained("untrusted_source")),
    ("helpfulness", "user", 1, Untrained("unknown_key")),
    ("Thumbs", "user", 1, Untrained("unknown_key")),     # keys match exactly
])
def test_a_score_maps_as_its_key_says(key, source, score, verdict):
    assert SPEC.judge(key, source, score) == verdict


def test_without_a_spec_every_score_is_its_own_reward():
    for key, source, score in [(None, "user", 0.3), ("arithmetic", "environment", -7.0), ("x", "judge", 1e6)]:
        assert judge_score(None, key, source, score) == Reward(score, 1.0)


def test_the_documented_spec_validates():
    section = DOC.read_text().split("## Which scores train: the reward spec", 1)[1]
    body = re.search(r"```json\n(.*?)```", section, flags=re.S).group(1)
    documented = RewardSpec.model_validate(json.loads(body))
    assert documented.judge("helpfulness", "user", 3) == Reward(0.5, 0.5)

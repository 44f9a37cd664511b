"""A tenant's reward spec: which feedback keys are rewards, how each value maps to a reward in
[0, 1], what it weighs, and whose word it takes. Part of the learning policy
(`clora.registry.LearningPolicy.reward_spec`); the ingest workers apply it to every scored
feedback record (`RewardSpec.judge`).

    {"keys": {
       "thumbs":      {"type": "bool", "sources": ["user"]},
       "helpfulness": {"type": "scale", "lo": 1, "hi": 5, "weight": 0.5, "sources": ["user", "operator"]},
       "latency_ms":  {"type": "scalar", "lo": 0, "hi": 5000, "invert": true, "sources": ["environment"]}}}

| type     | a valid value                 | reward                                   |
|----------|-------------------------------|------------------------------------------|
| `bool`   | 0 or 1                        | the value                                |
| `scale`  | an integer in [lo, hi]        | (v - lo) / (hi - lo)                     |
| `scalar` | any number                    | clipped to [lo, hi], then (v - lo) / (hi - lo) |

`invert` turns the reward r into 1 - r ("lower is better"). A record without a `key` is looked
up as `score`. A score the spec does not take (a key it does not name, a source the key does
not trust, a value outside a bool's or scale's range) is stored and listed but not trained on:
`judge` says why (`UntrainedReason`).

No spec at all (`reward_spec: null`, the default) keeps the rule from before specs existed:
every score trains as its own reward, weight 1, whatever its key and source (`judge_score`).
This module is ground: it imports nothing of clora's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

MAX_REWARD_KEYS = 32
"""The most keys one spec names."""
REWARD_KEY_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
"""A spec's key names: lower-case letters, digits, `_`, `.`, `-`, at most 64 characters."""
DEFAULT_KEY = "score"
"""The key a feedback record without one is looked up as."""

FeedbackSource = Literal["user", "operator", "environment", "judge"]
UntrainedReason = Literal["unknown_key", "untrusted_source", "out_of_range"]
UNTRAINED_REASONS: tuple[UntrainedReason, ...] = ("unknown_key", "untrusted_source", "out_of_range")


class RewardKey(BaseModel):
    """How one feedback key becomes a reward. Fields validate in order, so `lo` and `hi` are
    checked against `type` and `hi` against `lo`, each error naming its own field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["bool", "scale", "scalar"]
    lo: float | None = Field(default=None, ge=-1e6, le=1e6, validate_default=True)
    """The lowest value (`scale`: an integer; `scalar`: the low end of the range). None for `bool`."""
    hi: float | None = Field(default=None, ge=-1e6, le=1e6, validate_default=True)
    """The highest value, above `lo`. None for `bool`."""
    invert: bool = False
    """Lower is better: the reward is 1 minus the mapped value."""
    weight: float = Field(default=1.0, gt=0, le=1000)
    """How much a sample of this key counts in training (`RLSample.weight`)."""
    sources: list[FeedbackSource] = Field(min_length=1, max_length=4)
    """Who this key is trusted from; a score from any other source is not trained on."""

    @field_validator("lo", "hi")
    @classmethod
    def _bounds_fit_the_type(cls, v: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("type")
        if kind is None:                 # the type itself was wrong: that error is enough
            return v
        if kind == "bool":
            if v is not None:
                raise ValueError("a bool key takes no bounds (its values are 0 and 1)")
            return v
        if v is None:
            raise ValueError(f"a {kind} key needs both lo and hi")
        if kind == "scale" and v != int(v):
            raise ValueError(f"a scale's bounds are integers, not {v}")
        lo = info.data.get("lo")
        if info.field_name == "hi" and lo is not None and lo >= v:
            raise ValueError(f"hi ({v:g}) must be above lo ({lo:g})")
        return v

    @field_validator("sources")
    @classmethod
    def _distinct(cls, sources: list[str]) -> list[str]:
        if len(set(sources)) != len(sources):
            raise ValueError("a source is listed twice")
        return sources

    def reward(self, value: float) -> float | None:
        """`value` mapped to [0, 1] (inverted when `invert`), None when it is outside the
        type's range: a bool that is not 0 or 1, a scale value that is not an integer in
        [lo, hi]. A scalar is clipped, never out of range."""
        if self.type == "bool":
            if value not in (0.0, 1.0):
                return None
            r = float(value)
        else:
            lo, hi = float(self.lo), float(self.hi)   # type: ignore[arg-type]  # set for scale/scalar
            if self.type == "scale" and (value != int(value) or not lo <= value <= hi):
                return None
            r = (min(max(value, lo), hi) - lo) / (hi - lo)
        return 1.0 - r if self.invert else r


RewardKeyName = Annotated[str, StringConstraints(pattern=REWARD_KEY_PATTERN)]


class RewardSpec(BaseModel):
    """The feedback keys a tenant trains on, by name. A key not named here trains nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: dict[RewardKeyName, RewardKey] = Field(min_length=1, max_length=MAX_REWARD_KEYS)

    def judge(self, key: str | None, source: str, score: float) -> "Reward | Untrained":
        """What a score sent under `key` by `source` trains as, or why it does not."""
        rule = self.keys.get(key if key is not None else DEFAULT_KEY)
        if rule is None:
            return Untrained("unknown_key")
        if source not in rule.sources:
            return Untrained("untrusted_source")
        reward = rule.reward(score)
        if reward is None:
            return Untrained("out_of_range")
        return Reward(reward, rule.weight)


@dataclass(frozen=True)
class Reward:
    """A score the spec takes: `value` is the reward (in [0, 1] under a spec), `weight` what
    the sample counts in training."""

    value: float
    weight: float = 1.0


@dataclass(frozen=True)
class Untrained:
    """A score the spec does not take, and why."""

    reason: UntrainedReason


def judge_score(spec: RewardSpec | None, key: str | None, source: str, score: float) -> Reward | Untrained:
    """`spec.judge(...)`, or with no spec the rule from before specs: the score itself, weight 1."""
    return Reward(score) if spec is None else spec.judge(key, source, score)


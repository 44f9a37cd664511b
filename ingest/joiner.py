"""Join an interaction with one feedback record into training examples.

| feedback carries          | examples                                                   |
|---------------------------|------------------------------------------------------------|
| `correction`              | `SFTExample` (prompt -> correction) and, when the served     |
|                           | answer differs, a `PreferencePair` (correction > answer)   |
| `score` the reward spec   | `RLSample` (tokens, behaviour logprobs, reward, weight,    |
| takes                     | group id)                                                  |
| `score` it does not take  | none for the score (`untrained_reason` says why)           |
| only `comment`            | none (kept in the tenant's recent feedback for the console) |

The tenant's reward spec (`clora.reward_spec`) maps a score to its reward and weight; with no
spec every score is its own reward, weight 1. Example ids derive from the feedback event id,
so a redelivered event maps to the same ids.

`join_stored` is the ingest worker's join, on an interaction as it lies in the tenant's buffer
(its JSON, validated when it was stored). A score alone, most production feedback, becomes its
RL sample's JSON straight from that JSON (`StoredRLSample`), without building either model: the
same example `build_examples` makes, at about a quarter of the CPU. A correction takes the
models' path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic_core import from_json, to_json

from clora.reward_spec import Reward, RewardSpec, UntrainedReason, judge_score
from clora.ingest.schemas import FeedbackEvent, InteractionEvent, PreferencePair, RLSample, SFTExample


def _same_answer(a, b) -> bool:
    return a.model_dump(exclude={"name"}) == b.model_dump(exclude={"name"})


def untrained_reason(fb: FeedbackEvent, spec: RewardSpec | None) -> UntrainedReason | None:
    """Why `fb`'s score trains nothing under `spec`, or None when it trains (or has no score)."""
    if fb.score is None:
        return None
    verdict = judge_score(spec, fb.key, fb.source, fb.score)
    return None if isinstance(verdict, Reward) else verdict.reason


def build_examples(ix: InteractionEvent, fb: FeedbackEvent, spec: RewardSpec | None = None) -> list:
    """The examples `fb` makes of `ix` under the tenant's reward spec (None: no spec)."""
    if ix.tenant != fb.tenant:  # keys are per tenant, so this means a bug upstream
        raise _tenant_mismatch(fb, ix.tenant)
    common = dict(tenant=fb.tenant, interaction_id=ix.interaction_id, feedback_event_id=fb.event_id,
                  adapter_version=ix.adapter_version, time=fb.time, accepted_at=fb.accepted_at)
    out: list = []
    if fb.correction is not None:
        out.append(SFTExample(example_id=f"{fb.event_id}:sft", messages=ix.messages, tools=ix.tools,
                              target=fb.correction, **common))
        if not _same_answer(fb.correction, ix.response):
            out.append(PreferencePair(example_id=f"{fb.event_id}:pref", messages=ix.messages, tools=ix.tools,
                                      chosen=fb.correction, rejected=ix.response, **common))
    reward = judge_score(spec, fb.key, fb.source, fb.score) if fb.score is not None else None
    if isinstance(reward, Reward):
        out.append(RLSample(example_id=f"{fb.event_id}:rl", messages=ix.messages, tools=ix.tools,
                            response=ix.response, prompt_token_ids=ix.prompt_token_ids,
                            completion_token_ids=ix.completion_token_ids,
                            behaviour_logprobs=ix.completion_logprobs, reward=reward.value, weight=reward.weight,
                            group_id=ix.group_id or ix.interaction_id,
                            episode_id=ix.episode_id or ix.interaction_id, **common))
    return out


@dataclass(frozen=True, slots=True)
class StoredRLSample:
    """An `RLSample` as the buffer stores it: what the write reads of it (`kind`, ids, the
    tally's fields) and its JSON, which validates to the `RLSample` `build_examples` makes."""

    kind: ClassVar[str] = "rl"
    example_id: str
    group_id: str
    episode_id: str
    adapter_version: int | None
    reward: float
    json: str

    def model_dump_json(self) -> str:
        return self.json


def _tenant_mismatch(fb: FeedbackEvent, tenant: str) -> ValueError:
    return ValueError(f"feedback {fb.event_id} of tenant {fb.tenant} joined interaction of {tenant}")


def join_stored(stored: str | bytes, fb: FeedbackEvent, spec: RewardSpec | None = None) -> list:
    """`build_examples` of the interaction whose stored JSON is `stored` (written by the worker
    from a validated `InteractionEvent`, so not validated again on this path)."""
    if fb.correction is not None:
        return build_examples(InteractionEvent.model_validate_json(stored), fb, spec)
    reward = judge_score(spec, fb.key, fb.source, fb.score) if fb.score is not None else None
    if not isinstance(reward, Reward):
        return []
    ix = from_json(stored)
    if ix["tenant"] != fb.tenant:
        raise _tenant_mismatch(fb, ix["tenant"])
    interaction_id = ix["interaction_id"]
    group_id, episode_id = ix.get("group_id") or interaction_id, ix.get("episode_id") or interaction_id
    example_id = f"{fb.event_id}:rl"
    # RLSample's fields in its own order (`model_dump_json`); a test holds the two equal.
    body = {"example_id": example_id, "tenant": fb.tenant, "interaction_id": interaction_id,
            "feedback_event_id": fb.event_id, "adapter_version": ix.get("adapter_version"), "time": fb.time,
            "accepted_at": fb.accepted_at, "kind": "rl", "messages": ix["messages"], "tools": ix.get("tools"),
            "response": ix["response"], "prompt_token_ids": ix.get("prompt_token_ids"),
            "completion_token_ids": ix.get("completion_token_ids"),
            "behaviour_logprobs": ix.get("completion_logprobs"), "reward": float(reward.value),
            "group_id": group_id, "episode_id": episode_id, "weight": float(reward.weight)}
    return [StoredRLSample(example_id, group_id, episode_id, body["adapter_version"], body["reward"],
                           to_json(body).decode())]

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
"""

from __future__ import annotations

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
        raise ValueError(f"feedback {fb.event_id} of tenant {fb.tenant} joined interaction of {ix.tenant}")
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

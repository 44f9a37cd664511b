"""Join an interaction with one feedback record into training examples.

| feedback carries          | examples                                                   |
|---------------------------|------------------------------------------------------------|
| `correction`              | `SFTExample` (prompt -> correction) and, when the served     |
|                           | answer differs, a `PreferencePair` (correction > answer)   |
| `score`                   | `RLSample` (tokens, behaviour logprobs, reward, group id)  |
| only `comment`            | none (kept in the tenant's recent feedback for the console) |

Example ids derive from the feedback event id, so a redelivered event maps to the same ids.
"""

from __future__ import annotations

from clora.ingest.schemas import FeedbackEvent, InteractionEvent, PreferencePair, RLSample, SFTExample


def _same_answer(a, b) -> bool:
    return a.model_dump(exclude={"name"}) == b.model_dump(exclude={"name"})


def build_examples(ix: InteractionEvent, fb: FeedbackEvent) -> list:
    if ix.tenant != fb.tenant:  # keys are per tenant, so this means a bug upstream
        raise ValueError(f"feedback {fb.event_id} of tenant {fb.tenant} joined interaction of {ix.tenant}")
    common = dict(tenant=fb.tenant, interaction_id=ix.interaction_id, feedback_event_id=fb.event_id,
                  adapter_version=ix.adapter_version, time=fb.time)
    out: list = []
    if fb.correction is not None:
        out.append(SFTExample(example_id=f"{fb.event_id}:sft", messages=ix.messages, tools=ix.tools,
                              target=fb.correction, **common))
        if not _same_answer(fb.correction, ix.response):
            out.append(PreferencePair(example_id=f"{fb.event_id}:pref", messages=ix.messages, tools=ix.tools,
                                      chosen=fb.correction, rejected=ix.response, **common))
    if fb.score is not None:
        out.append(RLSample(example_id=f"{fb.event_id}:rl", messages=ix.messages, tools=ix.tools,
                            response=ix.response, prompt_token_ids=ix.prompt_token_ids,
                            completion_token_ids=ix.completion_token_ids,
                            behaviour_logprobs=ix.completion_logprobs, reward=fb.score,
                            group_id=ix.group_id or ix.interaction_id,
                            episode_id=ix.episode_id or ix.interaction_id, **common))
    return out

"""The forgetting guard: how far a tenant's candidate adapter moved the model away from the
base on general-purpose prompts, and whether that is within the tenant's tolerance.

The publish gate judges a candidate on the tenant's own held-out examples; a candidate can
do well there and still have forgotten how to answer anything else. So the gate also scores
it on a small general-purpose prompt set that ships with the project (`drift_prompts.jsonl`:
short questions, instructions and writing tasks, each with a reference answer).

Drift is the mean per-token KL divergence of the candidate from the base on the reference
answers, teacher-forced after each prompt:

    drift = sum over answer tokens t of KL(p_candidate(. | prefix_t) || p_base(. | prefix_t))
            / number of answer tokens                                      (nats per token)

where p_base is the same model with the adapter disabled. A zero adapter drifts 0; KL needs
no "right" answer (the references only give the prefixes a reply would have), so an adapter
that changes how the model answers these prompts drifts whether or not it gets them right.

The base's distributions never change within a learner process: they are computed once, the
first time any candidate is scored, and kept (`DriftProbe`: answer tokens x vocabulary floats,
~30 MB for SmolLM2 and 16 prompts). Each candidate then costs one forward over the prompts,
grouped into micro-batches by length so that they pad little.

Example: with `drift_tolerance` 0.3, a candidate whose drift is 0.12 nats per token publishes;
one at 0.45 is refused (`decide_drift`), and the console shows the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

import torch

from clora.ingest.schemas import Message, SFTExample
from clora.learner.batches import TokenBatch
from clora.learner.trainer import Trainer, plain_lm_head

PROMPT_SET = "drift_prompts.jsonl"
"""The general-purpose prompt set, package data of `clora.learner`."""


@dataclass(frozen=True)
class DriftPrompt:
    """One prompt of the set and the reference answer its drift is measured on. Example:
    `DriftPrompt("capital-france", "What is the capital of France?", "The capital of France is Paris.")`."""

    id: str
    prompt: str
    answer: str


def load_prompts(limit: int | None = None) -> list[DriftPrompt]:
    """The shipped prompt set, in file order (the first `limit` of it when given)."""
    text = resources.files("clora.learner").joinpath(PROMPT_SET).read_text(encoding="utf-8")
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(DriftPrompt(**json.loads(line)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{PROMPT_SET} line {n} is not a prompt with id, prompt and answer") from e
    return prompts[:limit]


@dataclass(frozen=True)
class DriftReading:
    """A candidate's drift from the base. Example: `DriftReading(kl=0.12, tokens=298, prompts=16)`:
    0.12 nats per answer token, over the 298 answer tokens of 16 prompts."""

    kl: float
    tokens: int
    prompts: int


@dataclass(frozen=True)
class DriftDecision:
    """Example: drift 0.45, tolerance 0.3 -> refused, "drift 0.450 nats/token from the base on 16
    general prompts exceeds the tenant's tolerance 0.300"."""

    publish: bool
    drift: float
    tolerance: float
    reason: str


def decide_drift(reading: DriftReading, tolerance: float) -> DriftDecision:
    """Refuse a candidate whose drift exceeds `tolerance` (or is NaN)."""
    where = f"from the base on {reading.prompts} general prompts"
    if math.isnan(reading.kl) or reading.kl > tolerance:
        return DriftDecision(False, reading.kl, tolerance, f"drift {reading.kl:.3f} nats/token {where} exceeds "
                                                           f"the tenant's tolerance {tolerance:.3f}")
    return DriftDecision(True, reading.kl, tolerance, f"drift {reading.kl:.3f} nats/token {where} is within "
                                                      f"the tenant's tolerance {tolerance:.3f}")


class DriftProbe:
    """Measures a tenant's current adapter's drift (`measure`) on the first `max_prompts` of the
    shipped set, with the trainer's model, encoder and micro-batch size."""

    def __init__(self, trainer: Trainer, max_prompts: int):
        self.trainer = trainer
        self.prompts = load_prompts(max_prompts)
        if not self.prompts:
            raise ValueError(f"{PROMPT_SET} has no prompts")
        self._head = plain_lm_head(trainer.model.model)
        self._batches: list[TokenBatch] | None = None
        self._base: list[torch.Tensor] | None = None
        """Per micro-batch, (N, V) log-probabilities of the base at its N answer positions."""

    def measure(self, tenant: str) -> DriftReading:
        """`tenant`'s current adapter (the store's state) against the base."""
        if self._base is None:
            self._batches = self._encode()
            with self.trainer.model.adapter_disabled():
                self._base = [self._answer_logprobs(b) for b in self._batches]
        self.trainer.store.activate(tenant)
        total, tokens = 0.0, 0
        for batch, base in zip(self._batches, self._base):
            mine = self._answer_logprobs(batch)                                   # (N, V)
            total += float((mine.exp() * (mine - base)).sum())
            tokens += base.shape[0]
        return DriftReading(total / tokens, tokens, len(self.prompts))

    def examples(self) -> list[SFTExample]:
        """The prompts with their reference answers as examples, in the set's order."""
        return [SFTExample(example_id=f"drift-{p.id}", tenant="drift", interaction_id=f"drift-{p.id}",
                           feedback_event_id=f"drift-{p.id}", time=0.0,
                           messages=[Message(role="user", content=p.prompt)],
                           target=Message(role="assistant", content=p.answer)) for p in self.prompts]

    def _encode(self) -> list[TokenBatch]:
        enc, mb = self.trainer.encoder, self.trainer.cfg.micro_batch_size
        # shortest first: each micro-batch pads to its longest row, and prompts of like length
        # together pad least (SmolLM2, 16 prompts in 8s: 584 positions against 680 in file order)
        examples = sorted(self.examples(), key=lambda e: int(enc.sft([e]).attention_mask.sum()))
        return [enc.sft(examples[i:i + mb]).to(self.trainer.device) for i in range(0, len(examples), mb)]

    @torch.no_grad()
    def _answer_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(N, V) float32 log-probabilities of the next token at each of the batch's N answer
        positions (where `loss_mask` is 1), under the model as it is bound now."""
        with self.trainer.autocast():                                             # bf16 products, if set
            where = batch.loss_mask.bool()                                        # (B, T-1)
            if self._head is None:
                logits = self.trainer.model(batch.input_ids, batch.attention_mask)[:, :-1][where]
            else:
                decoder, lm_head = self._head
                hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state               # (B, T, H)
                logits = lm_head(hidden[:, :-1][where])                           # (N, V)
            return torch.log_softmax(logits.float(), dim=-1)

"""Mixed steps: one step's examples split by the loss term each trains under (`auto`, `kto`).

Owns `Term`, `term_of` and `StepPlan`. Under `auto` a step takes whatever the replay buffer
holds and gives each example its term:

    SFTExample (a correction)             -> "sft"   sft_loss, token mean
    PreferencePair (correction vs answer) -> "dpo"   dpo_pair_losses against the base model
    RLSample in a group (a real group id) -> "pg"    clipped surrogate, group-normalised advantage
    RLSample alone (group id = its own    -> "pg"    clipped surrogate, advantage r - running mean
    interaction id: a thumbs up/down)        or "kto" (policy `unpaired`)

Under `kto` every RLSample is a "kto" sample. The step's objective is

    sum over terms T of  weight_T * (the mean over the step's T-examples of their loss)

so each term is as large as it would be alone, whatever the mix. Example: a step of 2 SFT
examples, 1 pair and 3 thumbs (`unpaired` "pg", baseline 0.4, rewards 1, 0, 1) has terms
("sft", "sft", "dpo", "pg", "pg", "pg") and advantages (0, 0, 0, 0.6, -0.4, 0.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from clora.learner.losses import (baseline_advantages, episode_weights, group_advantages, is_ungrouped, spec_weights,
                                  running_baseline)

Term = Literal["sft", "dpo", "pg", "kto"]


def term_of(example, algorithm: str, unpaired: str) -> Term:
    """The loss term `example` trains under in a mixed step (see the module doc)."""
    if example.kind == "sft":
        return "sft"
    if example.kind == "preference":
        return "dpo"
    if algorithm == "kto" or (unpaired == "kto" and is_ungrouped(example)):
        return "kto"
    return "pg"


@dataclass(frozen=True)
class StepPlan:
    """A mixed step's split. Example, the module doc's step: `terms` ("sft", "sft", "dpo", "pg",
    "pg", "pg"), `advantages` [0, 0, 0, 0.6, -0.4, 0.6], `baseline` 0.4 * m + 2/3 * (1 - m)."""

    terms: tuple[Term, ...]
    """One per example, in the step's order."""
    advantages: torch.Tensor
    """(B,) each "pg" sample's advantage, 0 for the others."""
    baseline: float | None
    """The tenant's reward baseline after this step (`AdapterState.reward_baseline`)."""

    def count(self, term: Term) -> int:
        return sum(t == term for t in self.terms)


def plan_step(examples: Sequence, algorithm: str, unpaired: str, baseline: float | None,
              momentum: float) -> StepPlan:
    """Each example's term and each policy-gradient sample's advantage: grouped samples
    normalised within their group (`group_advantages`, episodes counted once), ungrouped ones
    their reward minus `baseline` (the batch's ungrouped mean when None). The baseline then
    moves to include this step's ungrouped rewards (`running_baseline` with `momentum`)."""
    terms = tuple(term_of(e, algorithm, unpaired) for e in examples)
    adv = torch.zeros(len(examples))
    grouped = [i for i, (e, t) in enumerate(zip(examples, terms)) if t == "pg" and not is_ungrouped(e)]
    if grouped:
        g = [examples[i] for i in grouped]
        adv[torch.tensor(grouped)] = group_advantages(torch.tensor([s.reward for s in g]), [s.group_id for s in g],
                                                      [s.episode_id or s.example_id for s in g])
    alone = [i for i, e in enumerate(examples) if e.kind == "rl" and is_ungrouped(e)]
    rewards = torch.tensor([float(examples[i].reward) for i in alone])
    weights = episode_weights([examples[i].episode_id or examples[i].example_id for i in alone])
    pg_alone = [k for k, i in enumerate(alone) if terms[i] == "pg"]
    if pg_alone:
        a = baseline_advantages(rewards, baseline, weights)
        adv[torch.tensor([alone[k] for k in pg_alone])] = a[torch.tensor(pg_alone)]
    adv = adv * spec_weights(examples)  # each sample's reward-spec weight scales its term
    return StepPlan(terms, adv, running_baseline(baseline, rewards, momentum, weights) if alone else baseline)


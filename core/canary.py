"""The adapter canary: a replica must show that it applies a version's adapter, not the base
model answering under the adapter's name, before requests for that version are routed to it.

The learner that publishes a version runs one fixed prompt through its own model, with the
version's weights and without them, and stores the log-probability of each prompt token under
both in the version's metadata (`AdapterCanary`, `AdapterVersion.canary`). Serving, after it
loaded the version into a replica, asks that replica for the same prompt's log-probabilities
(vLLM's `prompt_logprobs`, one greedy token) under the adapter's served name and under the base,
and `AdapterCanary.check` judges the two answers.

Every comparison is a mean absolute difference over the prompt's tokens, in nats per token
(`mean_abs_diff`). With `base_gap` = replica base vs the learner's base, the tolerance is

    tolerance = CANARY_ATOL + CANARY_NOISE_FACTOR * base_gap

The base's own gap measures the arithmetic between the two sides on this very prompt: both fp32
(the learner on CPU, vLLM's CPU build) differ by ~1e-5 nats per token, so the tolerance is ~0.01;
a bf16 learner and a bf16 GPU vLLM (different kernels, bf16 keeps 8 bits of mantissa) differ by
~0.01-0.05, giving ~0.04-0.16. No dtype has to be configured, and the adapter path (LoRA deltas
on top of the same base arithmetic) gets three times the base's noise.

Verdicts (`CanaryVerdict.outcome`):
- `matched`: the replica's adapter answers within the tolerance of the learner's numbers;
- `indistinct`: matched, but this version is itself within the tolerance of the base on the
  prompt (a zero or freshly initialised adapter, an imported one that changes little): the canary
  cannot tell the adapter from the base; the version is served, and the verdict says so;
- `not_applied` (fails): the adapter's answer is the base's, not the version's;
- `mismatch` (fails): the answer is neither: another adapter under this name, a wrong folder;
- `base_mismatch` (fails): the replica's base is more than `CANARY_MAX_BASE_GAP` from the
  learner's: it serves another base model, so nothing can be compared;
- `malformed` (fails): the replica answered a different number of log-probabilities.

A version without a canary (published before canaries, by a test, or a `Publisher` built without
a model) gets `check_applied`: `applied` when the adapter answers measurably differently from
the base on the replica (more than `APPLIED_MIN`), else `unverified` (served, with the reason
logged: a zero adapter and an adapter vLLM ignored look the same without the learner's numbers).

Worked example (fp32): learner adapter [-2.10, -0.52], learner base [-2.90, -0.31]; the replica
answers adapter [-2.10003, -0.52001], base [-2.90002, -0.31001]: base_gap 1.5e-5, tolerance
0.01005, error 2e-5: `matched`. Had the replica answered the base for the adapter, error 0.505:
`not_applied`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

CANARY_ATOL = 0.01
"""Nats per token the replica's adapter may differ from the learner's beyond the base's own gap."""
CANARY_NOISE_FACTOR = 3.0
"""How many times the base's gap (learner vs replica arithmetic) the adapter path may add."""
CANARY_MAX_BASE_GAP = 0.5
"""Nats per token beyond which the replica's base is not the learner's base model."""
APPLIED_MIN = 1e-4
"""Without a canary: nats per token the adapter must differ from the base by to count as applied
(fp32 replicas are deterministic to ~1e-6 between batches)."""

Outcome = Literal["matched", "indistinct", "applied", "unverified", "not_applied", "mismatch", "base_mismatch",
                  "malformed"]


class AdapterCanary(BaseModel):
    """A prompt and the learner's log-probabilities of its tokens, with and without the adapter.
    Example: `AdapterCanary(prompt_token_ids=[1, 72, 105, 2], logprobs=[-3.1, -0.4, -1.2],
    base_logprobs=[-3.0, -0.9, -1.1], dtype="float32")`: `logprobs[i]` is log p(prompt[i + 1] |
    prompt[: i + 1]) under the adapter (so one fewer than the prompt's tokens)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=2, max_length=512)
    logprobs: list[float]
    """Under the version's adapter."""
    base_logprobs: list[float]
    """Under the base model alone."""
    dtype: str = "float32"
    """The arithmetic the learner computed them in (for the operator; the tolerance adapts by itself)."""

    @model_validator(mode="after")
    def _one_per_next_token(self) -> "AdapterCanary":
        n = len(self.prompt_token_ids) - 1
        if len(self.logprobs) != n or len(self.base_logprobs) != n:
            raise ValueError(f"a canary of {n + 1} tokens needs {n} log-probabilities under the adapter and under "
                             f"the base, got {len(self.logprobs)} and {len(self.base_logprobs)}")
        return self

    def separation(self) -> float:
        """How far this version is from the base on the prompt, by the learner's own numbers."""
        return mean_abs_diff(self.logprobs, self.base_logprobs)

    def check(self, adapter: Sequence[float], base: Sequence[float]) -> "CanaryVerdict":
        """Judge a replica's log-probabilities of the prompt's tokens under the adapter and the base."""
        n = len(self.logprobs)
        if len(adapter) != n or len(base) != n:
            return CanaryVerdict("malformed", f"the replica answered {len(adapter)} and {len(base)} log-probabilities "
                                              f"for a canary of {n}", math.nan, math.nan)
        base_gap = mean_abs_diff(base, self.base_logprobs)
        if not base_gap <= CANARY_MAX_BASE_GAP:   # NaN included
            return CanaryVerdict("base_mismatch", f"the replica's base model is {base_gap:.3g} nats/token from the "
                                                  f"learner's (more than {CANARY_MAX_BASE_GAP}): another base model?",
                                 math.nan, math.nan)
        tolerance = CANARY_ATOL + CANARY_NOISE_FACTOR * base_gap
        error = mean_abs_diff(adapter, self.logprobs)
        if not error <= tolerance:
            as_base = mean_abs_diff(adapter, base)
            if as_base <= tolerance:
                return CanaryVerdict("not_applied", f"the adapter is not applied: it answers as the base does "
                                                    f"({as_base:.3g} nats/token from it) and {error:.3g} from the "
                                                    f"version's canary (tolerance {tolerance:.3g})", error, tolerance)
            return CanaryVerdict("mismatch", f"the adapter answers {error:.3g} nats/token from the version's canary "
                                             f"(tolerance {tolerance:.3g}, base gap {base_gap:.3g}): another adapter "
                                             f"under this name?", error, tolerance)
        separation = self.separation()
        if separation <= tolerance:
            return CanaryVerdict("indistinct", f"matches ({error:.3g} nats/token, tolerance {tolerance:.3g}), but this "
                                               f"version is only {separation:.3g} from the base on the canary prompt: "
                                               f"the canary cannot tell it from the base", error, tolerance)
        return CanaryVerdict("matched", f"matches the version's canary ({error:.3g} nats/token, tolerance "
                                        f"{tolerance:.3g}; the base is {separation:.3g} away)", error, tolerance)


@dataclass(frozen=True)
class CanaryVerdict:
    """One replica's canary answer for one version. Example: `CanaryVerdict("mismatch", "the adapter
    answers 0.4210 nats/token from ...", error=0.421, tolerance=0.01)`."""

    outcome: Outcome
    reason: str
    error: float
    """Mean |replica adapter - expected| (nats per token); NaN when not compared."""
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.outcome in ("matched", "indistinct", "applied", "unverified")


def check_applied(adapter: Sequence[float], base: Sequence[float]) -> CanaryVerdict:
    """Without a canary: does the adapter change the replica's answer at all? Never fails (an
    untrained adapter equals the base); `unverified` says the check could not tell."""
    if len(adapter) != len(base):
        return CanaryVerdict("malformed", f"the replica answered {len(adapter)} log-probabilities under the adapter "
                                          f"and {len(base)} under the base", math.nan, math.nan)
    diff = mean_abs_diff(adapter, base)
    if diff > APPLIED_MIN:
        return CanaryVerdict("applied", f"no canary; the adapter differs from the base by {diff:.3g} nats/token",
                             diff, APPLIED_MIN)
    return CanaryVerdict("unverified", f"no canary, and the adapter answers as the base does ({diff:.2e} "
                                       "nats/token): a zero or untrained adapter, or one the replica does not apply",
                         diff, APPLIED_MIN)


def mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Mean |a[i] - b[i]| (nats per token); NaN for empty or unequal lengths."""
    if not a or len(a) != len(b):
        return math.nan
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

"""Tinker's losses on the learner's math: token **sums**, never means (docs/tinker-protocol.md §7.3).

`p` is the model's logprob of each `target_tokens` entry (B, T), `mask` (B, T) 1 on real
positions and 0 on padding. Each loss is summed over tokens and over datums, with the client's
per-token weights and advantages as sent: the SDK normalises on its side when it wants to.

    cross_entropy        -(p * weights).sum()                          `learner.losses.sequence_logprob`
    importance_sampling  -(exp(p - q) * A).sum()                       `clipped_surrogate`, no clip
    ppo                  -min(r A, clip(r, 1-eps, 1+eps) A).sum()      `clipped_surrogate`, eps 0.2

`q` is the `logprobs` input (the sampler's), `A` the `advantages` input, r = exp(p - q).
The learner's own objectives divide these sums by token and sample counts (`sft_loss`,
`policy_gradient_loss`); the Tinker endpoint must not. PPO's clip is fixed at 0.2, as Tinker
documents; `loss_fn_config` may set `clip_eps` (a number in (0, 1)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from clora.learner.losses import clipped_surrogate, sequence_logprob
from clora.trainapi.wire import TinkerDatum, WireError

REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
"""The losses this server computes, and the `loss_fn_inputs` each needs."""
PPO_CLIP_EPS = 0.2


def check_call(loss_fn: str, data: Sequence[TinkerDatum], config: Mapping[str, float | str],
               vocab_size: int, max_tokens: int) -> None:
    """`WireError` (naming the field) for a loss this server does not compute, a missing or
    wrongly typed input, a token outside the vocabulary or a datum longer than `max_tokens`."""
    if loss_fn not in REQUIRED_INPUTS:
        raise WireError("loss_fn", f"unsupported loss {loss_fn!r}: this server computes "
                                   f"{', '.join(REQUIRED_INPUTS)}")
    for key, value in config.items():
        if key != "clip_eps" or loss_fn != "ppo":
            raise WireError(f"loss_fn_config.{key}", f"{loss_fn} takes no {key!r} setting")
        if not isinstance(value, float) or not 0 < value < 1:
            raise WireError("loss_fn_config.clip_eps", "must be a number in (0, 1)")
    for i, d in enumerate(data):
        if d.tokens.size > max_tokens:
            raise WireError(f"data.{i}.model_input", f"{d.tokens.size} tokens exceed the limit of {max_tokens}")
        if d.tokens.min() < 0 or d.tokens.max() >= vocab_size:
            raise WireError(f"data.{i}.model_input", f"holds a token id outside the vocabulary [0, {vocab_size})")
        for name in REQUIRED_INPUTS[loss_fn]:
            if name not in d.inputs:
                raise WireError(f"data.{i}.loss_fn_inputs.{name}", f"is required by {loss_fn}")
        targets = d.inputs["target_tokens"]
        if targets.dtype != np.int64:
            raise WireError(f"data.{i}.loss_fn_inputs.target_tokens", "must be int64")
        if targets.min() < 0 or targets.max() >= vocab_size:
            raise WireError(f"data.{i}.loss_fn_inputs.target_tokens",
                            f"holds a token id outside the vocabulary [0, {vocab_size})")
        for name in REQUIRED_INPUTS[loss_fn][1:]:
            if d.inputs[name].dtype != np.float32:
                raise WireError(f"data.{i}.loss_fn_inputs.{name}", "must be float32")


def tinker_loss(loss_fn: str, p: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor,
                config: Mapping[str, float | str]) -> torch.Tensor:
    """The summed loss -> (); `p`, `mask` and each input (B, T) (see the module docstring)."""
    if loss_fn == "cross_entropy":
        return -sequence_logprob(p, inputs["weights"] * mask).sum()
    q, advantages = inputs["logprobs"], inputs["advantages"]
    eps = float("inf") if loss_fn == "importance_sampling" else float(config.get("clip_eps", PPO_CLIP_EPS))
    return clipped_surrogate(p, q, advantages, mask, eps).sum()

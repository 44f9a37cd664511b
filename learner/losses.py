"""Training losses as pure functions of log-probabilities (no model, no tokenizer).

Conventions: `logprobs` (B, T) are log p(token t | tokens < t) for the target tokens, `mask`
(B, T) is 1 where a token is part of the completion being learned (assistant tokens), else 0.

- `sft_loss`: mean negative log-likelihood over assistant tokens.
- `dpo_loss`: Rafailov et al. 2023, sequence log-probs summed over completion tokens; the
  reference is the base model with the adapter disabled.
- `group_advantages` + `policy_gradient_loss`: GRPO-style. Rewards are normalised within
  each group of rollouts of one prompt (each episode counted once); each token's ratio pi/pi_behaviour (behaviour =
  the serving-time logprobs) is clipped PPO-style; per-sample token mean, then the mean over
  samples (a row may hold several samples: an episode's turns, packed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t] | < t) for t >= 1. logits (B, T, V), input_ids (B, T) -> (B, T-1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-(sum of masked logprobs) / (number of masked tokens). (B, T), (B, T) -> ()."""
    n = mask.sum()
    if n == 0:
        raise ValueError("sft_loss: no assistant tokens in the batch (all masked out)")
    return -(logprobs * mask).sum() / n


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T), (B, T) -> (B,): sum of completion-token logprobs per sequence."""
    return (logprobs * mask).sum(-1)


def dpo_pair_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float | torch.Tensor) -> torch.Tensor:
    """-log sigmoid(beta * ((pc_i - rc_i) - (pr_i - rr_i))) per pair; inputs (B,) sequence logprobs,
    `beta` a float or (B,) one per pair -> (B,)."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """The mean of `dpo_pair_losses` -> ()."""
    return dpo_pair_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta).mean()


def group_advantages(rewards: torch.Tensor, group_ids: list[str], episode_ids: list[str] | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r_i - mean_g) / (std_g + eps) within each group g (population std), where the group's
    mean and std count each episode once: a sample of an episode with k samples in the group
    weighs 1/k (`episode_ids` None: every sample is its own episode). Each turn of an agent
    episode is a sample carrying the episode's reward; counted per turn, a group's baseline
    would lean toward its longer episodes (calc: a right answer takes two turns, a wrong one
    often one). A group of one sample has nothing to compare against: advantage 0.
    rewards (B,) -> (B,).
    Example: rewards [1, 0, 0.5, 2], groups [a, a, b, c] -> [1, -1, 0, 0] (approximately);
    rewards [1, 1, 0], groups [a, a, a], episodes [e1, e1, e2] -> [1, 1, -1]: mean 0.5 over the
    two episodes, not 0.67 over the three turns."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in dict.fromkeys(group_ids):
        members = [i for i, x in enumerate(group_ids) if x == g]
        if len(members) < 2:
            continue
        idx = torch.tensor(members)
        r = rewards[idx].float()
        if episode_ids is None:
            w = torch.ones_like(r)
        else:
            counts = Counter(episode_ids[i] for i in members)
            w = torch.tensor([1.0 / counts[episode_ids[i]] for i in members])
        mean = (w * r).sum() / w.sum()
        std = ((w * (r - mean) ** 2).sum() / w.sum()).sqrt()
        adv[idx] = (r - mean) / (std + eps)
    return adv


def sample_advantages(samples: Sequence) -> torch.Tensor:
    """`group_advantages` of RL samples (reward, group id, episode id; a sample that names no
    episode is its own)."""
    return group_advantages(torch.tensor([s.reward for s in samples]), [s.group_id for s in samples],
                            [s.episode_id or s.example_id for s in samples])


def has_reward_spread(rewards: Sequence[float], group_ids: Sequence[str]) -> bool:
    """Whether any group holds two different rewards, i.e. whether `group_advantages` gives
    any sample a non-zero advantage. Example: [1, 1, 0], groups [a, a, b] -> False."""
    seen: dict[str, float] = {}
    for r, g in zip(rewards, group_ids):
        if seen.setdefault(g, r) != r:
            return True
    return False


def sample_weights(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token weights for rows that hold one sample each: 1 / (the row's masked tokens)
    where the mask is 1, else 0. Example: mask [[1, 1], [1, 0]] -> [[0.5, 0.5], [1, 0]]."""
    return mask / mask.sum(-1, keepdim=True).clamp(min=1)


def behaviour_or_current(served: torch.Tensor | None, current: torch.Tensor) -> torch.Tensor:
    """The behaviour logprobs the surrogate compares with: the served ones (recorded when the
    sample was generated), and the current policy's, detached, where a sample has none (the
    whole batch: `served` None; some samples: NaN on their target tokens). Such a sample counts
    as on-policy: ratio 1. Example: served [[-1, nan]], current [[-2, -3]] -> [[-1, -3]]."""
    current = current.detach()
    if served is None:
        return current
    return torch.where(torch.isnan(served), current, served)


def clipped_surrogate(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                      weights: torch.Tensor, clip_eps: float | torch.Tensor = 0.2) -> torch.Tensor:
    """Clipped importance-sampled policy gradient (PPO/GRPO surrogate) per row -> (B,).

    ratio = exp(logprobs - behaviour_logprobs)             (B, T)
    per_token = -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)
    per row: the sum of per_token * weights. `advantages` is (B,), one per row, or (B, T), one
    per token; `weights` gives each target token 1 / (its sample's target tokens), 0 elsewhere,
    so a row's value is the sum of its samples' token-mean surrogates: with one sample per row
    (`sample_weights(mask)`) the token mean, with an episode's turns packed into one row (see
    `clora.learner.batches`) each turn's token mean, summed. `clip_eps` is a float or (B, 1).
    """
    ratio = torch.exp(logprobs - behaviour_logprobs)
    a = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    return (per_token * weights).sum(-1)


def policy_gradient_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                         weights: torch.Tensor, samples: int, clip_eps: float = 0.2) -> torch.Tensor:
    """`clipped_surrogate` summed over rows, divided by the number of samples they hold -> ():
    the mean over samples of each one's token-mean surrogate."""
    if samples < 1:
        raise ValueError(f"policy_gradient_loss needs at least one sample, got {samples}")
    return clipped_surrogate(logprobs, behaviour_logprobs, advantages, weights, clip_eps).sum() / samples

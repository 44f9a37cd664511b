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
- `baseline_advantages`, `running_baseline`: policy gradient without groups. A sample served
  alone (a thumbs up/down on one response) has no siblings to compare with; its advantage is
  its reward minus the tenant's running mean reward (the batch's mean while there is none),
  and it trains with the same clipped surrogate as a grouped one.
- `kto_losses`: Ethayarajh et al. 2024 (KTO), as TRL's `KTOTrainer` computes it: desirable and
  undesirable single responses, each against a reference point z0, the policy's KL from the
  reference estimated on mismatched prompt/completion pairs (`mismatched_pairs`).
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
    episode is its own), each scaled by its sample's `weight` (its feedback key's weight in the
    tenant's reward spec; 1 without one)."""
    return group_advantages(torch.tensor([s.reward for s in samples]), [s.group_id for s in samples],
                            [s.episode_id or s.example_id for s in samples]) * spec_weights(samples)


def spec_weights(samples: Sequence) -> torch.Tensor:
    """(B,) each RL sample's `weight` (the reward spec's weight of its feedback key), 1 for any
    other example. Example: RL samples weighing [1, 0.5] and an SFT example -> [1, 0.5, 1]."""
    return torch.tensor([float(s.weight) if s.kind == "rl" else 1.0 for s in samples])


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


def is_ungrouped(sample) -> bool:
    """Whether an RL sample was scored alone: its group id is its own interaction id (what the
    joiner gives a response served without a group), so no sibling shares its prompt."""
    return sample.group_id == sample.interaction_id


def episode_weights(episode_ids: Sequence[str]) -> torch.Tensor:
    """(B,) 1 / (samples of the sample's episode): an episode's turns share its reward and count
    once. Example: [e1, e1, e2] -> [0.5, 0.5, 1]."""
    counts = Counter(episode_ids)
    return torch.tensor([1.0 / counts[e] for e in episode_ids])


def baseline_advantages(rewards: torch.Tensor, baseline: float | None,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
    """r_i - b: `baseline` b (the tenant's running mean reward), or, when None (no history),
    the batch's mean reward with each sample weighing `weights` (None: 1 each). Not divided by a
    standard deviation: a batch of ungrouped thumbs may hold one reward value only.
    rewards (B,) -> (B,). Example: [1, 0, 1], baseline 0.25 -> [0.75, -0.25, 0.75]; baseline
    None -> [1/3, -2/3, 1/3]."""
    r = rewards.float()
    if baseline is None:
        w = torch.ones_like(r) if weights is None else weights.float()
        baseline = float((w * r).sum() / w.sum()) if len(r) else 0.0
    return r - baseline


def running_baseline(baseline: float | None, rewards: torch.Tensor, momentum: float,
                     weights: torch.Tensor | None = None) -> float | None:
    """The baseline after a batch: an exponential running mean, b <- m * b + (1 - m) * mean(r)
    (mean weighted by `weights`), starting at the first batch's mean. None stays None for an
    empty batch. Example: b 0.5, rewards [1, 1], m 0.9 -> 0.55."""
    if len(rewards) == 0:
        return baseline
    w = torch.ones_like(rewards, dtype=torch.float32) if weights is None else weights.float()
    mean = float((w * rewards.float()).sum() / w.sum())
    return mean if baseline is None else momentum * baseline + (1 - momentum) * mean


def mismatched_pairs(n: int) -> list[int]:
    """For KTO's KL estimate: row i pairs prompt i with completion `out[i]`, the previous row's
    (TRL's `_get_kl_dataset` rotates a batch's completions by one). Example: 3 -> [2, 0, 1];
    1 -> [0] (a lone sample is paired with itself: the estimate is then on matched text)."""
    return [(i - 1) % n for i in range(n)]


def kto_kl(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: mean over the mismatched pairs of log pi(y_j|x_i) -
    log pi_ref(y_j|x_i), detached (no gradient flows through it), clamped at 0. (M,), (M,) -> ()."""
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_losses(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO's loss per sample (eq. 7 of the paper; TRL's `kto_loss` with loss_type "kto").

    Semantics, with r_i = policy_logps_i - ref_logps_i (sequence logprobs, summed over the
    completion) and z0 = `kl`:
        desirable i:    lambda_D * (1 - sigmoid(beta * (r_i - z0)))
        undesirable i:  lambda_U * (1 - sigmoid(beta * (z0 - r_i)))
    policy_logps, ref_logps (B,), desirable (B,) bool, kl () -> (B,). The step's KTO term is
    their mean (TRL: the mean over the concatenated desirable and undesirable losses)."""
    r = policy_logps - ref_logps
    good = 1 - torch.sigmoid(beta * (r - kl))
    bad = 1 - torch.sigmoid(beta * (kl - r))
    return torch.where(desirable, desirable_weight * good, undesirable_weight * bad)

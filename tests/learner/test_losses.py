"""Loss functions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from clora.learner.losses import (dpo_loss, group_advantages, has_reward_spread, policy_gradient_loss,
                                  sample_advantages, sample_weights, sequence_logprob, sft_loss, token_logprobs)

from .helpers import rl


def test_token_logprobs_shift_by_one():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    ids = torch.tensor([[0, 1, 2]])  # position 0 predicts id 1 (p=.25), position 1 predicts id 2 (p=.1)
    torch.testing.assert_close(token_logprobs(logits, ids), torch.log(torch.tensor([[0.25, 0.1]])))


def test_sft_loss_counts_only_assistant_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    assert sft_loss(lp, mask).item() == pytest.approx((2 + 3 + 6) / 3)
    with pytest.raises(ValueError, match="no assistant tokens"):
        sft_loss(lp, torch.zeros_like(mask))


def test_dpo_loss_hand_computed():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    assert sequence_logprob(lp, torch.tensor([[1.0, 1.0], [0.0, 1.0]])).tolist() == [-3.0, -0.5]
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    beta = 0.5
    # margins: ((-1+2) - (-3+2)) = 2 ; ((-2+2) - (-1+2)) = -1
    expected = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(0.5)))) / 2
    assert dpo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(expected, rel=1e-6)
    # policy == reference: log 2
    assert dpo_loss(rc, rr, rc, rr, beta).item() == pytest.approx(math.log(2))


def test_group_advantages_normalise_within_groups():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 2.0, 0.0]), ["a", "a", "b", "c", "c", "c", "c"])
    # group a: mean .5, std .5 -> [1, -1]; b alone -> 0; c: mean 2, std sqrt(2) -> [0, 1.414, 0, -1.414]
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, math.sqrt(2), 0.0, -math.sqrt(2)]),
                               atol=1e-5, rtol=1e-5)


def test_group_advantages_count_each_episode_once():
    # one right episode of two turns and one wrong episode of one turn: the baseline is 0.5
    # (two episodes), not 0.67 (three turns), so right and wrong get +1 and -1
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0]), ["a", "a", "a"], ["e1", "e1", "e2"])
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0]), atol=1e-5, rtol=1e-5)
    per_turn = group_advantages(torch.tensor([1.0, 1.0, 0.0]), ["a", "a", "a"])
    assert per_turn[0] < 1.0 - 0.2 and per_turn[2] < -1.0 - 0.2      # what counting turns gave
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 2.0, 0.0]), ["a", "a", "b", "c", "c", "c", "c"]
    torch.testing.assert_close(group_advantages(rewards, groups, [str(i) for i in range(7)]),
                               group_advantages(rewards, groups))   # one sample per episode: as before


def test_sample_advantages_take_episode_ids_and_count_a_sample_without_one_alone():
    samples = [rl("t", i, "q?", "a", r, "g", episode_id=e) for i, (r, e) in enumerate([(1.0, "e1"), (1.0, "e1"),
                                                                                        (0.0, None)])]
    torch.testing.assert_close(sample_advantages(samples), torch.tensor([1.0, 1.0, -1.0]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rewards, groups, spread", [
    ([1.0, 0.0, 0.5], ["a", "a", "b"], True),
    ([1.0, 1.0, 0.0], ["a", "a", "b"], False),         # b has one sample: nothing to compare against
    ([], [], False),
])
def test_has_reward_spread_says_whether_any_advantage_is_non_zero(rewards, groups, spread):
    assert has_reward_spread(rewards, groups) is spread
    assert bool(group_advantages(torch.tensor(rewards), groups).abs().gt(0).any()) is spread


def test_policy_gradient_loss_clips_ratio():
    lp = torch.log(torch.tensor([[0.5, 0.9], [0.2, 0.2]]))
    blp = torch.log(torch.tensor([[0.25, 0.9], [0.4, 0.2]]))  # ratios: [2, 1], [0.5, 1]
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # seq 0 (A=+1): token ratios 2 -> min(2, 1.2) = 1.2 ; 1 -> 1  => mean -(1.2 + 1)/2 = -1.1
    # seq 1 (A=-1): ratio .5 -> -min(-.5, -.8) = .8 (clip keeps the pessimistic bound); token 2 masked
    assert policy_gradient_loss(lp, blp, adv, sample_weights(mask), 2, clip_eps=0.2).item() == pytest.approx((-1.1 + 0.8) / 2, rel=1e-5)
    # gradient flows only through unclipped tokens
    lp2 = lp.clone().requires_grad_(True)
    policy_gradient_loss(lp2, blp, adv, sample_weights(mask), 2, 0.2).backward()
    assert lp2.grad[0, 0] == 0 and lp2.grad[0, 1] != 0 and lp2.grad[1, 0] == 0 and lp2.grad[1, 1] == 0

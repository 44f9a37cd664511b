"""RL turn packing: an episode's earlier turns ride in its later turn's row, with the loss and
gradient of one row per sample."""

from __future__ import annotations

import pytest
import torch

from clora.learner.adapter_store import AdapterStore
from clora.learner.batches import ChatEncoder, Sequence, micro_batches, pack_turns
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainingPolicy

from .helpers import mixed_logprob_rl, rl


def _seq(prompt, completion, logprobs=True):
    return Sequence(list(prompt), list(completion), [-0.5] * len(completion) if logprobs else None)


def test_each_turn_packs_into_its_continuation_and_identical_turns_into_different_rows():
    seqs = [
        _seq([1, 2, 3], [4, 5]),                   # 0: episode a, turn 0
        _seq([1, 2, 3, 4, 5, 6], [7, 8]),          # 1: a, turn 1
        _seq([1, 2, 3], [4, 5]),                   # 2: episode b, turn 0 (the same tokens as a's)
        _seq([1, 2, 3, 4, 5, 9], [10]),            # 3: b, turn 1
        _seq([1, 2, 3, 4, 5, 6, 7, 8, 11], [12]),  # 4: a, turn 2
        _seq([1, 2, 3], [13]),                     # 5: episode c, one turn
    ]
    # rows in the order of their longest sequence, members shortest first; a's turns 0-2 share
    # turn 2's row, b's turn 0 (a's tokens, but those positions are taken) rides with b's turn 1
    assert pack_turns(seqs, max_len=64) == [[2, 3], [0, 1, 4], [5]]
    # turn 2's row would be 10 tokens: longer than max_len, it takes no one; turn 1 takes turn 0
    assert pack_turns(seqs, max_len=9) == [[0, 1], [2, 3], [4], [5]]


def test_only_exact_token_prefixes_with_the_same_kind_of_logprobs_pack():
    turn0, turn1 = _seq([1, 2, 3], [4, 5]), _seq([1, 2, 3, 4, 5, 6], [7])
    assert pack_turns([turn0, turn1], 64) == [[0, 1]]
    assert pack_turns([_seq([1, 2, 3], [4, 9]), turn1], 64) == [[0], [1]]            # another completion
    assert pack_turns([_seq([1, 2, 3], [4, 5], logprobs=False), turn1], 64) == [[0], [1]]  # on-policy vs served


def test_micro_batches_keep_a_packed_row_whole(tiny):
    _, tok = tiny
    enc = ChatEncoder(tok, 64)
    ep = [rl("t", i, "q", "a", 1.0, "g", prompt_token_ids=p, completion_token_ids=c, behaviour_logprobs=[-1.0] * len(c))
          for i, (p, c) in enumerate([([5, 6, 7, 8, 9, 10], [11]), ([5, 6, 7], [8, 9]), ([5, 6], [20])])]
    assert micro_batches(enc, ep, 1) == [[1, 0], [2]]
    assert micro_batches(ChatEncoder(tok, 64, pack_turns=False), ep, 2) == [[0, 1], [2]]
    assert micro_batches(enc, [], 4) == []
    with pytest.raises(ValueError, match="micro-batch size"):
        micro_batches(enc, ep, 0)


def _episode_samples(tok, tenant="acme"):
    """Two groups of two-turn episodes whose later turns' prompts are the earlier turns' served
    tokens plus a tool result: turn 1 of each episode starts with turn 0's prompt + completion."""
    out = []
    for g in range(2):
        prompt = tok(f"<|im_start|>user\nquestion {g}?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        for e, (answer, reward) in enumerate((("call(1+1)", 1.0), ("call(2*3)", 0.0), ("call(1+1)", 0.5))):
            c0 = tok(f"{answer}<|im_end|>")["input_ids"]
            p1 = prompt + c0 + tok(f"\n<|im_start|>user\nresult {e}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
            c1 = tok(f"final {e}<|im_end|>")["input_ids"]
            for turn, (p, c) in enumerate(((prompt, c0), (p1, c1))):
                lp = [-0.3 - 0.01 * k for k in range(len(c))]
                out.append(rl(tenant, 100 * g + 10 * e + turn, f"question {g}?", "x", reward, f"g{g}",
                              prompt_token_ids=p, completion_token_ids=c, behaviour_logprobs=lp))
    return out


def test_a_packed_rl_batch_has_the_loss_and_gradient_of_one_row_per_sample(tiny):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lm)
    store.register("acme", seed=0)
    samples = _episode_samples(tok)
    policy = TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=len(samples))
    adv = torch.linspace(-1.0, 1.0, len(samples))
    weights = torch.randn(store.state("acme").master.shape, generator=torch.Generator().manual_seed(0)) * 0.05
    results = {}
    for pack in (False, True):
        tr = Trainer(lm, ChatEncoder(tok, 128, pack_turns=pack), store)   # every episode fits a row
        slot = store.activate("acme")
        slot.master.copy_(weights)                       # away from B = 0, so every LoRA matrix gets gradient
        slot.sync_weights()
        slot.grad.zero_()
        lm.train()
        loss, n, _ = tr._loss(samples, policy, adv)
        loss.backward()
        slot.fold_grads()
        batch = tr.encoder.rl(samples, adv)
        results[pack] = (float(loss.detach()), n, slot.grad.clone(), int(batch.attention_mask.sum()), batch.input_ids.shape[0])
    (loss_u, n_u, grad_u, tokens_u, rows_u), (loss_p, n_p, grad_p, tokens_p, rows_p) = results[False], results[True]
    assert rows_u == 12 and rows_p == 6                  # each episode's two turns in one row
    assert tokens_p < 0.75 * tokens_u                    # the first turns' tokens are not run twice
    assert n_p == n_u                                    # the same target tokens
    assert loss_p == pytest.approx(loss_u, rel=1e-5, abs=1e-7)
    assert float(grad_u.abs().max()) > 1e-4
    torch.testing.assert_close(grad_p, grad_u, rtol=1e-4, atol=1e-6)


def test_a_truncated_sample_is_never_a_packed_row(tiny):
    _, tok = tiny
    enc = ChatEncoder(tok, 8)
    turn0 = rl("t", 0, "q", "a", 1.0, "g", prompt_token_ids=[5, 6, 7], completion_token_ids=[8],
               behaviour_logprobs=[-1.0])
    turn1 = rl("t", 1, "q", "a", 0.0, "g", prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12], completion_token_ids=[13],
               behaviour_logprobs=[-2.0])
    batch = enc.rl([turn0, turn1], torch.tensor([1.0, -1.0]))
    assert batch.input_ids.shape[0] == 2 and batch.samples == 2   # 9 tokens > 8: turn 1 is cut, alone
    assert batch.input_ids[1].tolist() == [6, 7, 8, 9, 10, 11, 12, 13]
    assert batch.weights.sum().item() == pytest.approx(2.0)        # one whole sample's weight per row
    assert batch.advantages[1, -1].item() == -1.0 and batch.behaviour_logprobs[1, -1].item() == -2.0


def test_a_step_reports_the_rows_it_ran(tiny):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    samples = _episode_samples(tok)
    policy = TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=len(samples))
    for pack, rows in ((True, 6), (False, 12)):
        tr = Trainer(lm, ChatEncoder(tok, 128, pack_turns=pack), AdapterStore(lm))
        tr.store.register("acme", seed=0)
        result = tr.train_step("acme", samples, policy)
        assert (result.examples, result.rows) == (12, rows)


def test_a_sample_without_served_logprobs_is_on_policy_beside_samples_with_them(tiny):
    """Each sample's surrogate is the same alone or in a batch with the other kind: the one
    without served logprobs gets the current policy's (ratio 1), never 0 (ratio exp(logprob))."""
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lm)
    store.register("acme", seed=0)
    tr = Trainer(lm, ChatEncoder(tok, 128), store)
    store.activate("acme")
    served, unserved = mixed_logprob_rl("acme")
    policy = TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=2)
    with torch.no_grad():
        both = float(tr._loss([served, unserved], policy, torch.tensor([1.0, -1.0]))[0])
        alone = [float(tr._loss([s], policy, torch.tensor([a]))[0]) for s, a in ((served, 1.0), (unserved, -1.0))]
    batch = tr.encoder.rl([served, unserved], torch.tensor([1.0, -1.0]))
    assert torch.isnan(batch.behaviour_logprobs).any() and not torch.isnan(batch.behaviour_logprobs[batch.loss_mask == 0]).any()
    assert alone[1] == pytest.approx(1.0)                # ratio 1, advantage -1: the surrogate is 1
    assert both == pytest.approx(sum(alone) / 2, rel=1e-6)

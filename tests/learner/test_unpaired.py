"""Learning from unpaired feedback: KTO against TRL's loss, the ungrouped policy gradient's
baseline, mixed `auto` steps, and a tenant with only thumbs up/down moving toward the rewarded
answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from clora.learner.adapter_store import AdapterStore
from clora.learner.batches import ChatEncoder
from clora.learner.checkpoint import load_checkpoint, save_checkpoint
from clora.learner.losses import (baseline_advantages, group_advantages, kto_kl, kto_losses, mismatched_pairs,
                                  policy_gradient_loss, running_baseline, sample_weights, sequence_logprob)
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.metrics import LearnerMetrics
from clora.learner.mixed import plan_step
from clora.learner.process import Learner
from clora.learner.sampling import fresh_across
from clora.learner.trainer import Trainer, TrainingPolicy
from clora.registry import LearningPolicy, Tenant

from .helpers import FakeBuffer, pref, rl, sft
from .test_checkpoint import P, _state



def _kto_trainer():
    """TRL's KTO trainer module, the independent reference (a test dependency: its absence is
    a failure, not a skip)."""
    import trl.experimental.kto.kto_trainer as kto_trainer

    return kto_trainer


def thumb(tenant: str, i: int, answer: str, reward: float, question: str = "sky colour?"):
    """A response scored alone: its group id is its own interaction id (`i-<i>`)."""
    return rl(tenant, i, question, answer, reward, f"i-{i}")


# --- KTO against TRL ------------------------------------------------------------------------

def _trl_kto(beta: float, lambda_d: float, lambda_u: float):
    """TRL's `KTOTrainer.kto_loss`, bound to the few attributes it reads (one process: the
    accelerator's gather is the identity)."""
    fake = SimpleNamespace(calculate_KL=True, beta=beta, loss_type="kto", desirable_weight=lambda_d,
                           undesirable_weight=lambda_u,
                           accelerator=SimpleNamespace(gather_for_metrics=lambda x: x, device="cpu"))
    return lambda *args: _kto_trainer().KTOTrainer.kto_loss(fake, *args)


@pytest.mark.parametrize("beta, lambda_d, lambda_u", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.7, 1.5)])
def test_kto_losses_equal_trls_on_the_same_tensors(beta, lambda_d, lambda_u):
    g = torch.Generator().manual_seed(0)
    policy, ref = -5 * torch.rand(6, generator=g), -5 * torch.rand(6, generator=g)
    desirable = torch.tensor([True, False, True, True, False, False])
    policy_kl, ref_kl = -5 * torch.rand(6, generator=g), -6 * torch.rand(6, generator=g)
    ours = kto_losses(policy, ref, desirable, kto_kl(policy_kl, ref_kl), beta, lambda_d, lambda_u)
    theirs, _, _, kl = _trl_kto(beta, lambda_d, lambda_u)(policy[desirable], policy[~desirable], policy_kl,
                                                          ref[desirable], ref[~desirable], ref_kl)
    torch.testing.assert_close(kto_kl(policy_kl, ref_kl), kl)
    torch.testing.assert_close(torch.cat([ours[desirable], ours[~desirable]]), theirs)
    torch.testing.assert_close(ours.mean(), theirs.nanmean())    # TRL's loss: the mean of the losses


def test_kto_kl_is_clamped_at_zero_and_carries_no_gradient():
    policy_kl = torch.tensor([-3.0, -4.0], requires_grad=True)
    assert kto_kl(policy_kl, torch.tensor([-1.0, -1.0])).item() == 0.0      # policy below reference: z0 = 0
    z0 = kto_kl(policy_kl, torch.tensor([-5.0, -5.0]))
    assert z0.item() == pytest.approx(1.5) and not z0.requires_grad


def test_mismatched_pairs_rotate_completions_as_trl_does():
    batch = {"answer_input_ids": [[1], [2], [3], [4]], "answer_attention_mask": [[1]] * 4}
    rotated = _kto_trainer()._get_kl_dataset({k: list(v) for k, v in batch.items()})["answer_input_ids"]
    assert [batch["answer_input_ids"][j] for j in mismatched_pairs(4)] == rotated
    assert mismatched_pairs(1) == [0]


def test_kto_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(1)
    policy = (-3 * torch.rand(5, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = -3 * torch.rand(5, generator=g, dtype=torch.float64)
    desirable = torch.tensor([True, False, True, False, False])
    kl = torch.tensor(0.3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda p: kto_losses(p, ref, desirable, kl, 0.7, 1.2, 0.8), (policy,))
    # a desirable sample's loss falls as its log-ratio rises, an undesirable one's rises
    grad = torch.autograd.grad(kto_losses(policy, ref, desirable, kl, 0.7).sum(), policy)[0]
    assert (grad[desirable] < 0).all() and (grad[~desirable] > 0).all()


# --- the ungrouped policy gradient --------------------------------------------------------

def test_baseline_advantages_use_the_running_mean_or_the_batch_mean():
    r = torch.tensor([1.0, 0.0, 1.0])
    torch.testing.assert_close(baseline_advantages(r, 0.25), torch.tensor([0.75, -0.25, 0.75]))
    torch.testing.assert_close(baseline_advantages(r, None), torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    # an episode's two turns count once: mean (1 + 0) / 2, not 2 / 3
    torch.testing.assert_close(baseline_advantages(r, None, torch.tensor([0.5, 1.0, 0.5])),
                               torch.tensor([0.5, -0.5, 0.5]))
    assert running_baseline(None, r, 0.9) == pytest.approx(2 / 3)
    assert running_baseline(0.5, torch.tensor([1.0, 1.0]), 0.9) == pytest.approx(0.55)
    assert running_baseline(0.5, torch.tensor([]), 0.9) == 0.5


def test_policy_gradient_gradients_match_finite_differences_with_baseline_advantages():
    g = torch.Generator().manual_seed(2)
    behaviour = -torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5
    # within the clip range (ratios 0.9 .. 1.1 for eps 0.2): the surrogate is smooth there
    lp = (behaviour + 0.1 * (2 * torch.rand(3, 4, generator=g, dtype=torch.float64) - 1)).requires_grad_(True)
    adv = baseline_advantages(torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), 0.4).double()
    w = sample_weights(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x: policy_gradient_loss(x, behaviour, adv, w, 3, 0.2), (lp,))


def test_plan_step_keeps_group_advantages_and_gives_ungrouped_samples_the_baseline():
    grouped = [rl("t", i, "2+2?", a, r, "g") for i, (a, r) in enumerate([("4", 1.0), ("5", 0.0)])]
    alone = [thumb("t", 10, "blue", 1.0), thumb("t", 11, "red", 0.0), thumb("t", 12, "blue", 1.0)]
    examples = [sft("t", 20, "q?", "a"), *grouped, pref("t", 21, "q?", "x", "y"), *alone]
    plan = plan_step(examples, "auto", "pg", 0.4, 0.9)
    assert plan.terms == ("sft", "pg", "pg", "dpo", "pg", "pg", "pg")
    torch.testing.assert_close(plan.advantages[1:3], group_advantages(torch.tensor([1.0, 0.0]), ["g", "g"]))
    torch.testing.assert_close(plan.advantages[4:], torch.tensor([0.6, -0.4, 0.6]))
    assert plan.advantages[0] == 0 and plan.advantages[3] == 0
    assert plan.baseline == pytest.approx(0.9 * 0.4 + 0.1 * 2 / 3)
    kto = plan_step(examples, "auto", "kto", None, 0.9)
    assert kto.terms[4:] == ("kto",) * 3 and kto.terms[1:3] == ("pg", "pg") and not kto.advantages[4:].any()
    assert plan_step(examples, "kto", "pg", None, 0.9).terms[1:3] == ("kto", "kto")


def test_the_reward_baseline_survives_a_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path, _state(reward_baseline=0.625), P)
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["clora_state"])["extras"] == {"reward_baseline": 0.625}
    assert load_checkpoint(path, P).reward_baseline == 0.625


def test_fresh_across_takes_the_oldest_examples_of_every_kind_without_skipping_any():
    class SeqBuffer(FakeBuffer):  # one sequence counter across kinds, as the Redis buffer has
        def __init__(self, seqs):
            super().__init__()
            self.seqs = seqs                                  # kind -> sequence numbers, ascending

        def newer_than(self, tenant, kind, cursor):
            return sum(s > cursor for s in self.seqs[kind])

        def sample(self, tenant, kind, n, *, cursor=0, fresh_fraction=0.5, seed=None, fill=True):
            fresh = [s for s in self.seqs[kind] if s > cursor][:n]
            return SimpleNamespace(examples=[(kind, s) for s in fresh], cursor=fresh[-1] if fresh else cursor,
                                   fresh=len(fresh))

    buf = SeqBuffer({"sft": [9, 12], "preference": [], "rl": [10, 11, 13, 14]})
    got = fresh_across(buf, "t", ("sft", "preference", "rl"), 4, cursor=8)
    assert sorted(got.examples, key=lambda e: e[1]) == [("sft", 9), ("rl", 10), ("rl", 11), ("sft", 12)]
    assert got.cursor == 12
    rest = fresh_across(buf, "t", ("sft", "preference", "rl"), 4, cursor=got.cursor)
    assert rest.examples == [("rl", 13), ("rl", 14)] and rest.cursor == 14


def test_the_registry_policy_takes_auto_and_kto_and_checks_their_fields():
    assert LearningPolicy().algorithm == "auto" and LearningPolicy().unpaired == "pg"
    assert LearningPolicy(algorithm="auto", unpaired="kto").unpaired == "kto"
    for bad in ({"unpaired": "dpo"}, {"kto_beta": 0}, {"reward_baseline_momentum": 1.0}, {"pg_weight": -1},
                {"algorithm": "auto", "sft_weight": 0, "dpo_weight": 0, "pg_weight": 0, "kto_weight": 0},
                {"algorithm": "kto", "kto_weight": 0}):
        with pytest.raises(ValueError):
            LearningPolicy(**bad)


# --- training -----------------------------------------------------------------------------

def _trainer(tiny) -> Trainer:
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    return Trainer(lm, ChatEncoder(tok, 64), AdapterStore(lm))


def _answer_logprob(tr: Trainer, tenant: str, answer: str, question: str = "sky colour?") -> float:
    tr.store.activate(tenant)
    b = tr.encoder.sft([sft(tenant, 0, question, answer)])
    with torch.no_grad():
        return float(sequence_logprob(tr._logprobs(b), b.loss_mask)[0])


@pytest.mark.parametrize("algorithm, examples", [
    ("sft", [sft("t", i, f"q{i}?", "blue" + " sky" * i) for i in range(3)]),
    ("rl", [rl("t", i, "2+2?", a, r, "g") for i, (a, r) in enumerate([("4", 1.0), ("five", 0.0), ("4!", 1.0)])]),
    ("dpo", [pref("t", i, f"q{i}?", "yes", "no") for i in range(3)]),
])
def test_auto_on_one_kind_takes_the_same_step_as_that_kinds_algorithm(tiny_model_dir, algorithm, examples):
    from clora.learner.base_model import load_base_model

    states = []
    for alg in (algorithm, "auto"):
        tr = _trainer(load_base_model(tiny_model_dir))
        tr.cfg = tr.cfg.model_copy(update={"micro_batch_size": 2})
        tr.store.register("t", seed=0)
        policy = TrainingPolicy(algorithm=alg, learning_rate=1e-2, batch_size=3)
        losses = [tr.train_step("t", examples, policy).loss for _ in range(2)]
        states.append((losses, tr.store.state("t").buffer.clone()))
    assert states[1][0] == pytest.approx(states[0][0], rel=1e-6)
    torch.testing.assert_close(states[1][1], states[0][1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("unpaired", ["pg", "kto"])
def test_thumbs_alone_move_a_tenant_toward_the_rewarded_answer(tiny, unpaired):
    tr = _trainer(tiny)
    tr.store.register("t", seed=0)
    thumbs = [thumb("t", i, "blue" if i % 2 == 0 else "red", 1.0 if i % 2 == 0 else 0.0) for i in range(4)]
    policy = TrainingPolicy(algorithm="auto", unpaired=unpaired, learning_rate=2e-2, batch_size=4,
                            kto_beta=1.0)
    blue, red = _answer_logprob(tr, "t", "blue"), _answer_logprob(tr, "t", "red")
    for _ in range(3):
        tr.train_step("t", thumbs, policy)
    assert _answer_logprob(tr, "t", "blue") > blue + 0.1
    assert _answer_logprob(tr, "t", "red") < red - 0.1
    assert tr.store.state("t").reward_baseline == pytest.approx(0.5)      # every step's mean is 0.5


def _thumbs_learner(settings, reg, buf, tiny_model_dir) -> Learner:
    """A learner beside a tenant `thumbs` (auto, batch 4) whose buffer holds 12 thumbs: "blue"
    up, "red" down, alternating, and one held-out "blue" up."""
    from clora.learner.base_model import load_base_model

    reg.tenants["thumbs"] = Tenant(id="thumbs", policy=LearningPolicy(algorithm="auto", learning_rate=2e-2,
                                                                      batch_size=4, min_new_examples=4))
    for i in range(12):
        buf.add(thumb("thumbs", i, "blue" if i % 2 == 0 else "red", 1.0 if i % 2 == 0 else 0.0))
    buf.add(thumb("thumbs", 99, "blue", 1.0), held_out=True)
    model, tok = load_base_model(tiny_model_dir)
    return Learner(settings, model, tok, registry=reg, buffer=buf, announce=lambda e: None,
                   base_model_name=str(tiny_model_dir), metrics=LearnerMetrics())


def test_a_learner_tenant_with_only_thumbs_under_auto_learns_the_rewarded_answer(world, tiny_model_dir):
    settings, reg, buf = world
    for t in ("acme", "beta"):
        reg.tenants[t].policy.paused = True
    lr = _thumbs_learner(settings, reg, buf, tiny_model_dir)
    assert lr.lifecycle.admit(reg.tenants["thumbs"])                  # registered as the loop would
    blue, red = _answer_logprob(lr.trainer, "thumbs", "blue"), _answer_logprob(lr.trainer, "thumbs", "red")
    trained = [lr.tick() for _ in range(4)]
    assert trained == ["thumbs"] * 3 + [None]                # 12 thumbs, 4 a step, each once
    assert _answer_logprob(lr.trainer, "thumbs", "blue") > blue + 0.1
    assert _answer_logprob(lr.trainer, "thumbs", "red") < red - 0.1
    assert lr.store.peek("thumbs").cursor == 12 and lr.store.peek("thumbs").reward_baseline == pytest.approx(0.5)
    versions = reg.adapter_versions("thumbs")      # gated on the held-out thumb's answer: published
    assert versions and versions[-1].eval_scores["eval_loss"] < versions[0].eval_scores["eval_loss"] + 1e-6


def test_in_fused_mode_an_auto_tenant_takes_serial_steps_beside_the_fused_ones(world, tiny_model_dir):
    settings, reg, buf = world
    settings = settings.model_copy(update={"training_mode": "fused", "fused_max_tenants": 2,
                                           "fused_max_chunk_tokens": 64})
    reg.tenants["beta"].policy.paused = True
    lr = _thumbs_learner(settings, reg, buf, tiny_model_dir)
    assert lr.fused is not None and lr.lifecycle.admit(reg.tenants["thumbs"])
    blue = _answer_logprob(lr.trainer, "thumbs", "blue")
    trained = [set(lr.tick_fused()) for _ in range(4)]
    assert trained == [{"acme", "thumbs"}] * 3 + [set()]     # both train every tick; nobody backs off
    assert lr.store.peek("thumbs").step == 3 and lr.store.peek("acme").step == 3
    assert lr.fused.slots.slot_of("thumbs") is None           # never held a fused slot
    assert _answer_logprob(lr.trainer, "thumbs", "blue") > blue + 0.1


def test_a_samples_reward_spec_weight_scales_its_advantage_grouped_and_alone():
    from clora.learner.losses import sample_advantages

    grouped = [rl("t", 0, "q", "a", 1.0, "g"), rl("t", 1, "q", "b", 0.0, "g", weight=0.5)]
    plain = [rl("t", 0, "q", "a", 1.0, "g"), rl("t", 1, "q", "b", 0.0, "g")]
    assert torch.allclose(sample_advantages(grouped), sample_advantages(plain) * torch.tensor([1.0, 0.5]))
    alone = [thumb("t", 0, "blue", 1.0), thumb("t", 1, "red", 0.0).model_copy(update={"weight": 3.0})]
    plan = plan_step(alone, "auto", "pg", baseline=0.5, momentum=0.9)
    assert plan.advantages.tolist() == pytest.approx([0.5, -1.5])   # (1 - 0.5) x 1, (0 - 0.5) x 3

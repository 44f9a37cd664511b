"""The forgetting guard: the shipped prompt set, drift from the base (0 for a zero adapter,
growing as an adapter trains), and the publish gate refusing a candidate beyond the tenant's
tolerance while publishing within it."""

from __future__ import annotations

import math

import pytest
import torch

from clora.learner.adapter_store import AdapterStore
from clora.learner.base_model import load_base_model
from clora.learner.batches import ChatEncoder
from clora.learner.drift import DriftProbe, DriftReading, decide_drift, load_prompts
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy

from .helpers import sft
from .test_process import _learner


def test_the_prompt_set_ships_with_the_package():
    prompts = load_prompts()
    assert len(prompts) >= 24 and len({p.id for p in prompts}) == len(prompts)
    assert all(p.prompt.strip() and p.answer.strip() for p in prompts)
    assert load_prompts(16) == prompts[:16]


def test_a_zero_adapter_does_not_drift_and_a_trained_one_drifts_more_as_it_trains(tiny_model_dir, monkeypatch):
    model, tok = load_base_model(tiny_model_dir)
    lora = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lora, prefetch=False)
    trainer = Trainer(lora, ChatEncoder(tok, 128), store, TrainerConfig(micro_batch_size=4))
    probe = DriftProbe(trainer, 6)
    store.register("acme", 1)
    base_runs = []
    disabled = lora.adapter_disabled
    monkeypatch.setattr(lora, "adapter_disabled", lambda: base_runs.append(1) or disabled())
    zero = probe.measure("acme")                  # a fresh LoRA (B = 0) is the base
    assert zero.kl == pytest.approx(0.0, abs=1e-6) and zero.prompts == 6 and zero.tokens > 6
    policy = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)
    drifts = []
    for step in range(4):
        trainer.train_step("acme", [sft("acme", 4 * step + k, f"q{k}?", "blue") for k in range(4)], policy)
        drifts.append(probe.measure("acme").kl)
    assert 0 < drifts[0] < drifts[1] < drifts[2] < drifts[3]
    assert base_runs == [1]                       # the base's distributions are computed once


def test_under_autocast_a_zero_adapter_still_does_not_drift_and_a_trained_one_reads_as_in_fp32(tiny_model_dir):
    model, tok = load_base_model(tiny_model_dir)
    lora = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lora, prefetch=False)
    probes = {mode: DriftProbe(Trainer(lora, ChatEncoder(tok, 128), store,
                                       TrainerConfig(micro_batch_size=4, autocast=mode)), 6)
              for mode in ("off", "bfloat16")}
    store.register("acme", 1)
    seen = []
    model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    assert probes["bfloat16"].measure("acme").kl == pytest.approx(0.0, abs=1e-6)   # base and candidate alike
    assert set(seen) == {torch.bfloat16}
    trainer = Trainer(lora, ChatEncoder(tok, 128), store, TrainerConfig(micro_batch_size=4))
    policy = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)
    for step in range(3):
        trainer.train_step("acme", [sft("acme", 4 * step + k, f"q{k}?", "blue") for k in range(4)], policy)
    fp32, bf16 = (probes[m].measure("acme").kl for m in ("off", "bfloat16"))
    assert fp32 > 0.01 and bf16 == pytest.approx(fp32, rel=0.1)


def test_the_prompts_run_in_micro_batches_of_like_length_and_measure_as_in_file_order(tiny_model_dir):
    model, tok = load_base_model(tiny_model_dir)
    lora = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lora, prefetch=False)
    trainer = Trainer(lora, ChatEncoder(tok, 128), store, TrainerConfig(micro_batch_size=4))
    store.register("acme", 1)
    policy = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)
    trainer.train_step("acme", [sft("acme", k, f"q{k}?", "blue") for k in range(4)], policy)
    probe = DriftProbe(trainer, 16)
    sorted_kl = probe.measure("acme").kl
    rows = [int(n) for b in probe._batches for n in b.attention_mask.sum(1)]
    assert rows == sorted(rows)
    in_file_order = DriftProbe(trainer, 16)
    examples = in_file_order.examples()
    in_file_order._encode = lambda: [trainer.encoder.sft(examples[i:i + 4]).to(trainer.device)
                                     for i in range(0, len(examples), 4)]
    assert sum(b.input_ids.numel() for b in probe._batches) < sum(
        b.input_ids.numel() for b in in_file_order._encode())
    assert sorted_kl > 0.01 and sorted_kl == pytest.approx(in_file_order.measure("acme").kl, rel=1e-4)


def test_decide_drift():
    within = decide_drift(DriftReading(kl=0.12, tokens=300, prompts=16), 0.3)
    assert within.publish and "within the tenant's tolerance 0.300" in within.reason
    beyond = decide_drift(DriftReading(kl=0.45, tokens=300, prompts=16), 0.3)
    assert not beyond.publish and beyond.reason == ("drift 0.450 nats/token from the base on 16 general prompts "
                                                    "exceeds the tenant's tolerance 0.300")
    assert not decide_drift(DriftReading(kl=math.nan, tokens=300, prompts=16), 0.3).publish


def test_the_gate_refuses_a_candidate_beyond_the_tenants_tolerance_and_says_why(world, tiny_model_dir):
    _, reg, buf = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner(world, tiny_model_dir, [])
    acme = reg.tenants["acme"].policy
    acme.drift_tolerance = 1e-6                   # any training drifts further
    assert lr.tick() == "acme"
    assert reg.adapter_versions("acme") == []
    m = lr.metrics.registry
    assert m.get_sample_value("clora_learner_publishes_total", {"tenant": "acme", "outcome": "drift"}) == 1
    (refusal,) = [p for p in reg.history["acme"] if "refused" in p]
    assert refusal["drift"] > 1e-6 and refusal["drift"] == m.get_sample_value("clora_learner_drift", {"tenant": "acme"})
    assert "exceeds the tenant's tolerance 0.000" in refusal["refused"]
    acme.drift_tolerance = 100.0                  # within: published, with its drift
    assert lr.tick() == "acme"
    (v1,) = reg.adapter_versions("acme")
    assert v1.eval_scores["drift"] > refusal["drift"]
    acme.drift_tolerance = None                   # off: not even measured
    assert lr.tick() == "acme"
    assert "drift" not in reg.adapter_versions("acme")[-1].eval_scores


def test_a_tenant_a_guard_paused_publishes_nothing(world, tiny_model_dir, monkeypatch):
    """A tenant a guard pauses after it was picked (another learner's guard, while this one
    draws its batch) still takes the step it was picked for, but does not publish it. (A pause
    by this learner's own guards comes before the pick: `test_hacking_guard`.)"""
    _, reg, _ = world
    reg.tenants["beta"].policy.paused = True
    lr = _learner(world, tiny_model_dir, [])
    draw = lr.sampler.draw

    def paused_while_drawing(tid, policy):
        reg.update_policy("acme", paused=True, paused_reason="reward hacking: ...")
        return draw(tid, policy)

    monkeypatch.setattr(lr.sampler, "draw", paused_while_drawing)
    assert lr.tick() == "acme"
    assert reg.adapter_versions("acme") == []
    assert lr.metrics.registry.get_sample_value("clora_learner_publishes_total",
                                                {"tenant": "acme", "outcome": "paused"}) == 1

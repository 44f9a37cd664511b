"""The learner on a CUDA device: what only a GPU run exercises.

On CUDA the adapter store pins its host buffers and swaps through a side copy stream (with
prefetch, the next tenant's copy overlaps the current step), LoRA dropout draws its masks from
each tenant's CPU generator and copies them over, and the fused trainer runs the Triton
segmented kernels. These tests hold that path to the CPU path's results:
- a tenant trained on CUDA between other tenants' swaps is bit-identical to one trained alone
  on CUDA (a missed stream wait or an unpinned, reused buffer shows up as a difference);
- CUDA steps equal CPU steps (SFT, DPO and RL, with dropout) to 1e-3 of each state row's
  largest magnitude: other kernels round differently (~1e-6 relative), a wrong or lost mask,
  a stale swap or a missed gradient is off by O(1);
- a fused step on CUDA with the Triton kernels equals solo CUDA steps, to the same bound;
- the learner loop on CUDA (serial and fused) publishes the versions a CPU learner publishes.
Skipped without CUDA; `benchmarks/gpu_checks.sh` runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clora.learner.adapter_store import MASTER
from clora.learner.fused import FusedTrainer, TenantWork
from clora.learner.lora import LoraSpec
from clora.learner.trainer import Trainer, TrainingPolicy

from .helpers import COMPARISON_ADAM, assert_states_close, comparison_trainer, learner_world, mixed_work, sft_set
from .test_process import _learner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REL_TOL = 1e-3
DROPOUT = LoraSpec(rank=4, alpha=8, dropout=0.1)
NO_DROPOUT = LoraSpec(rank=4, alpha=8)


def _trainer(model_dir, device: str, spec: LoraSpec = DROPOUT) -> Trainer:
    return comparison_trainer(model_dir, spec, device=device, prefetch=True)


def test_swaps_with_prefetch_on_cuda_are_bit_identical_to_training_alone(tiny_model_dir):
    policy = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)
    alone = _trainer(tiny_model_dir, "cuda")
    alone.store.register("acme", seed=11)
    for _ in range(3):
        alone.train_step("acme", sft_set("acme", "yes"), policy)

    mixed = _trainer(tiny_model_dir, "cuda")
    for t, seed in (("acme", 11), ("beta", 12), ("gamma", 13)):
        mixed.store.register(t, seed=seed)
    other = policy.model_copy(update={"learning_rate": 5e-2})
    for _ in range(3):
        mixed.train_step("acme", sft_set("acme", "yes"), policy, prefetch="beta")
        mixed.train_step("beta", sft_set("beta", "no no"), other, prefetch="gamma")
        mixed.train_step("gamma", sft_set("gamma", "maybe"), other, prefetch="acme")

    want, got = alone.store.state("acme"), mixed.store.state("acme")
    assert got.buffer.device.type == "cpu" and got.buffer.is_pinned(), "host state must be pinned on CUDA"
    assert got.step == want.step == 3
    assert torch.equal(got.rng_state, want.rng_state)
    for row, name in enumerate(("master", "exp_avg", "exp_avg_sq", "grad")):
        assert torch.equal(got.buffer[row], want.buffer[row]), f"{name} differs after interleaving on CUDA"
    assert not torch.equal(mixed.store.state("beta").buffer[MASTER], got.buffer[MASTER])
    assert mixed.store.stats.prefetch_hits >= 6


def test_cuda_steps_equal_cpu_steps_for_every_algorithm_with_dropout(tiny_model_dir):
    data = mixed_work()
    cpu, cuda = _trainer(tiny_model_dir, "cpu"), _trainer(tiny_model_dir, "cuda")
    for i, t in enumerate(data):
        cpu.store.register(t, seed=100 + i)
        cuda.store.register(t, seed=100 + i)
    for _ in range(3):
        for t, (examples, policy) in data.items():
            cpu.train_step(t, examples, policy)
            cuda.train_step(t, examples, policy)
    assert_states_close(cpu, cuda, data, REL_TOL)
    acme = data["acme"]
    assert cuda.eval_loss("acme", *acme) == pytest.approx(cpu.eval_loss("acme", *acme), rel=1e-3)


@pytest.mark.parametrize("spec", [DROPOUT, NO_DROPOUT], ids=["dropout", "bucketed"])
def test_fused_triton_step_on_cuda_equals_solo_cuda_steps(tiny_model_dir, spec):
    data = {t: w for t, w in mixed_work().items() if t in ("acme", "beta", "gamma", "delta")}
    serial, fused = _trainer(tiny_model_dir, "cuda", spec), _trainer(tiny_model_dir, "cuda", spec)
    ft = FusedTrainer(fused, 2, backend="triton")
    assert (ft.max_chunk_tokens, ft.max_padding) == (16384, 1.0)  # launch-bound: few, wide chunks
    for i, t in enumerate(data):
        serial.store.register(t, seed=100 + i)
        fused.store.register(t, seed=100 + i)
    for _ in range(2):
        for group in (["acme", "beta"], ["gamma", "delta"], ["delta", "acme"]):
            for t in group:
                serial.train_step(t, *data[t])
            res = ft.train_step([TenantWork(t, *data[t]) for t in group])
            assert sorted(r.tenant for r in res.results) == sorted(group)
    ft.flush()
    assert_states_close(serial, fused, data, REL_TOL)


@pytest.mark.parametrize("mode", ["serial", "fused"])
def test_the_learner_loop_on_cuda_publishes_what_it_publishes_on_cpu(tiny_model_dir, tmp_path, mode):
    """The whole loop (schedule, train, gate on held-out loss, publish PEFT folders, checkpoint)
    with the model and the resident tenants on CUDA: every version both devices published holds
    the same step count and the same weights, to the bound above."""
    published, steps = {}, {}
    for device in ("cpu", "cuda"):
        settings, reg, buf = learner_world(tmp_path / device)
        settings = settings.model_copy(update={"training_mode": mode, "device": device})
        learner = _learner((settings, reg, buf), tiny_model_dir, [], device=device)
        assert learner.store.device.type == torch.device(device).type
        cfg = learner.trainer.cfg.model_copy(update={"adam": COMPARISON_ADAM})
        learner.trainer.cfg = cfg
        if learner.fused is not None:
            learner.fused.cfg = cfg
        while learner.tick() is not None:
            pass
        versions = {t: reg.adapter_versions(t) for t in ("acme", "beta")}
        assert all(versions.values()), f"{device}: a tenant published nothing"
        published[device] = {(t, v.version): load_file(Path(v.path) / "adapter_model.safetensors")
                             for t, vs in versions.items() for v in vs}
        steps[device] = {(t, v.version): v.step for t, vs in versions.items() for v in vs}
    both = published["cpu"].keys() & published["cuda"].keys()
    assert {t for t, _ in both} == {"acme", "beta"}
    for key in sorted(both):
        assert steps["cuda"][key] == steps["cpu"][key], key
        want, got = published["cpu"][key], published["cuda"][key]
        assert want.keys() == got.keys() and all(t.device.type == "cpu" for t in got.values())
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=REL_TOL * float(w.abs().max()) + 1e-7,
                                       msg=lambda m: f"{key} {name}: {m}")

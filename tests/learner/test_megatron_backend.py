"""The megatron learner backend against the default one, on the same tenant data: tensor parallel
T=2 (two gloo processes), T=1, data parallel D=2 at T=1 (two processes, each running half of
every batch's rows) and, marked slow, T=2 x D=2 (four processes) give the default backend's
per-token logprobs, LoRA gradients, losses and states after several steps of SFT, DPO and RL, and
published adapters, within tolerances of float32 summation order; a tenant's steps do not depend
on another tenant's in between.

Tolerances: T=2 sums the same products in another order (each rank's partial matmul, then an
all-reduce), and megatron's attention masks with -10000 and normalises with torch's RMSNorm where
the HF model uses finfo.min and its own fp32 RMSNorm: ~1e-6 per forward in fp32. Measured on the
tiny model: logprobs 4e-6 apart (bound 1e-5 + 1e-5 relative), gradients 3e-7 (bound 1e-4 of the
largest), weights after 3-4 Adam steps at lr 1e-2 1.4e-5 (bound 1% of lr per step: 3-4e-4).
D=2 adds the two replicas' gradients in another order: the same bounds hold (measured at T=1 x
D=2: logprobs 1.9e-6 apart, gradients 1.6e-7, weights after 3 steps 4.9e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clora.learner.base_model import load_base_model
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.peft_io import read_adapter

from . import megatron_job
from .helpers import pref, rl, sft_set

pytest.importorskip("megatron.core")

SPEC = dict(rank=4, alpha=8.0, dropout=0.1)
BACKENDS = ["tp1", "tp2", "dp2"]
"""Megatron runs of the scenario: T=1; T=2; T=1 x D=2."""
LR = 1e-2


def _job(model_dir: Path, layout_numel: int) -> dict:
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(layout_numel, generator=g) * 0.05   # B non-zero: A's gradient is not trivially 0
    sft_p = dict(algorithm="sft", learning_rate=LR, batch_size=4)
    dpo_p = dict(algorithm="dpo", learning_rate=LR, batch_size=2)
    rl_p = dict(algorithm="rl", learning_rate=LR, batch_size=4)
    pairs = [pref("b", i, f"pick {i}?", "the good one", "bad") for i in range(2)]
    group = [rl("c", 10 + i, "2+2?", ans, reward, "g1") for i, (ans, reward) in
             enumerate((("4", 1.0), ("5", 0.0), ("four", 1.0), ("22", 0.0)))]
    steps = [("alone", 11, sft_p, sft_set("alone", "yes"))] * 3
    for _ in range(2):   # `a` takes `alone`'s steps, with `b`'s and `c`'s in between
        steps += [("a", 11, sft_p, sft_set("alone", "yes")), ("b", 12, dpo_p, pairs), ("c", 13, rl_p, group)]
    steps += [("a", 11, sft_p, sft_set("alone", "yes"))]
    return {"model_dir": str(model_dir), "spec": SPEC, "flat": flat, "probe": sft_set("p", "a longer answer", 3),
            "steps": steps}


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    model, tok = load_base_model(tiny_model_dir)
    default = LoraModel(model, LoraSpec(**SPEC))
    job = _job(tiny_model_dir, default.layout.numel)
    (tmp / "default").mkdir()
    ref = megatron_job.run(default, tok, job, tmp / "default")
    return {"default": ref, "tp1": megatron_job.torchrun(job, 1, tmp / "tp1"),
            "tp2": megatron_job.torchrun(job, 2, tmp / "tp2"),
            "dp2": megatron_job.torchrun(job, 1, tmp / "dp2", dp=2),
            "job": job, "tmp": tmp, "layout": default.layout}


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    err = (got - want).abs().max().item()
    assert torch.allclose(got, want, rtol=rtol, atol=atol), f"{what}: max abs error {err:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_and_lora_gradients_match_the_default_backend(results, backend):
    got, want = results[backend], results["default"]
    mask = want["probe_mask"].bool()
    assert mask.sum() > 10
    _close(got["probe_logprobs"][mask], want["probe_logprobs"][mask], 1e-5, 1e-5, "per-token logprobs")
    g, w = got["probe_grad"], want["probe_grad"]
    assert w.abs().max() > 1e-3, "the reference gradient is ~0: the comparison would prove nothing"
    _close(g, w, 1e-4, 1e-4 * w.abs().max().item(), "LoRA gradient")


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_and_states_after_sft_dpo_and_rl_steps_match(results, backend):
    got, want = results[backend], results["default"]
    assert [s[:2] for s in got["steps"]] == [s[:2] for s in want["steps"]]
    for (tenant, step, loss, norm), (_, _, wloss, wnorm) in zip(got["steps"], want["steps"]):
        assert abs(loss - wloss) <= 1e-4 * max(1.0, abs(wloss)), f"{tenant} step {step}: loss {loss} vs {wloss}"
        assert abs(norm - wnorm) <= 1e-3 * max(1.0, wnorm), f"{tenant} step {step}: grad norm {norm} vs {wnorm}"
    for tenant, buf in want["states"].items():
        steps = sum(1 for s in want["steps"] if s[0] == tenant)
        # Adam moves a weight by at most ~lr per step whatever the gradient's scale: allow 1% of that
        _close(got["states"][tenant][0], buf[0], 0, 0.01 * LR * steps, f"{tenant}'s weights")
        _close(got["states"][tenant][1], buf[1], 1e-3, 1e-6, f"{tenant}'s Adam first moment")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tenants_steps_do_not_depend_on_other_tenants_steps_in_between(results, backend):
    """`alone` and `a` start from the same seed and take the same three SFT steps (LoRA dropout on,
    from each tenant's own generator); `a` has `b`'s DPO and `c`'s RL steps in between."""
    states = results[backend]["states"]
    assert torch.equal(states["a"], states["alone"])
    assert not torch.equal(states["a"][0], states["b"][0])


def test_published_adapters_are_peft_files_the_default_backend_loads(results):
    tmp, layout = results["tmp"], results["layout"]
    for tenant in ("a", "b", "c"):
        want = read_adapter(tmp / "default" / f"adapter-{tenant}", layout)
        for backend in BACKENDS:
            got = read_adapter(tmp / backend / f"adapter-{tenant}", layout)
            _close(got, want, 1e-3, 2e-5, f"{backend}'s published adapter of {tenant}")
            assert torch.equal(got, results[backend]["states"][tenant][0])


def test_batches_split_over_replicas_in_rows_even_when_uneven_or_empty():
    from clora.learner.megatron_tp import DataSplit, row_slices

    assert row_slices(5, 2) == [slice(0, 3), slice(3, 5)]
    assert row_slices(1, 2) == [slice(0, 1), slice(1, 1)]
    positions = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0]], dtype=torch.bool)   # (B=3, T=3)
    split = DataSplit.of(3, 2, positions)
    assert split.counts == [3, 2] and split.axis == 1
    # the replicas' shards hold (row, position) in their own sequence-major order; `order` puts
    # them back in the whole batch's sequence-major order
    local = [(0, 0), (1, 1), (0, 2), (2, 0), (2, 1)]   # replica 0: rows 0-1; replica 1: row 2
    whole = [(0, 0), (2, 0), (1, 1), (2, 1), (0, 2)]
    assert [local[i] for i in split.order.tolist()] == whole


def test_t_by_d_must_match_the_launched_processes_with_an_error_naming_the_settings(monkeypatch):
    import torch.distributed as dist

    from clora.learner.megatron_tp import MegatronBackendError, _free_port, init_parallel

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(MegatronBackendError, match=r"CLORA_LEARNER_TENSOR_PARALLEL \(1\) x "
                                                       r"CLORA_LEARNER_DATA_PARALLEL \(2\) = 2 processes.*has 1"):
            init_parallel(1, 2, timeout_s=30)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_and_data_parallel_together_match_the_default_backend(results):
    """T=2 x D=2: four processes, two replicas of a two-way split base."""
    got, want = megatron_job.torchrun(results["job"], 2, results["tmp"] / "tp2dp2", dp=2), results["default"]
    mask = want["probe_mask"].bool()
    _close(got["probe_logprobs"][mask], want["probe_logprobs"][mask], 1e-5, 1e-5, "per-token logprobs")
    w = want["probe_grad"]
    _close(got["probe_grad"], w, 1e-4, 1e-4 * w.abs().max().item(), "LoRA gradient")
    for (tenant, step, loss, _), (_, _, wloss, _) in zip(got["steps"], want["steps"]):
        assert abs(loss - wloss) <= 1e-4 * max(1.0, abs(wloss)), f"{tenant} step {step}: loss {loss} vs {wloss}"
    for tenant, buf in want["states"].items():
        steps = sum(1 for s in want["steps"] if s[0] == tenant)
        _close(got["states"][tenant][0], buf[0], 0, 0.01 * LR * steps, f"{tenant}'s weights")
    assert torch.equal(got["states"]["a"], got["states"]["alone"])


def test_a_base_or_settings_the_backend_cannot_run_get_an_error_naming_why():
    from pydantic import ValidationError
    from transformers import LlamaConfig

    from clora.learner.megatron_tp import MegatronBackendError, check_supported
    from clora.learner.settings import LearnerSettings

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          vocab_size=49152)
    check_supported(smollm2, 3)
    with pytest.raises(MegatronBackendError, match=r"num_attention_heads \(9\).*num_key_value_heads \(3\)"):
        check_supported(smollm2, 2)
    with pytest.raises(ValidationError, match="training_mode serial"):
        LearnerSettings(backend="megatron", training_mode="fused")
    with pytest.raises(ValidationError, match="needs backend megatron"):
        LearnerSettings(tensor_parallel=2)
    with pytest.raises(ValidationError, match="data_parallel 2 needs backend megatron"):
        LearnerSettings(data_parallel=2)

"""Equivalence: a fused step over K tenants == K solo (serial) steps on the same data.

Tolerance, fp32: every row of a tenant's state (master weights, Adam exp_avg, exp_avg_sq)
agrees with the serial run to within `REL_TOL` = 1e-4 of that row's largest magnitude
(observed: ~5e-6 after 3 steps); step counts, RNG states and the zeroed grad rows agree
exactly. Not bit-exact because the fused batch is padded to its widest tenant (other matmul
and attention shapes, so other blocking and summation order in BLAS) and the segmented
kernel computes x @ A @ B * scale in another association than the solo `F.linear` chain:
both give fp32 rounding differences of ~1e-7 relative per op, which Adam passes through.
A wrong normalisation (e.g. one mean over all tenants' tokens) would be off by O(1).

Both layouts of a fused step are covered: without LoRA dropout sequences bucket freely across
tenants and micro-batches (per-sequence loss weights carry the serial normalisation); with
dropout whole micro-batches stay together so the dropout masks are drawn as in solo steps.
"""

from __future__ import annotations

import pytest
import torch

from clora.learner.adapter_store import MASTER
from clora.learner.fused import FusedTrainer, TenantWork
from clora.learner.fused_slots import FusedCapacityError
from clora.learner.lora import LoraSpec
from clora.learner.trainer import Trainer

from .helpers import assert_states_close, comparison_trainer, mixed_work

REL_TOL = 1e-4
SPEC = LoraSpec(rank=4, alpha=8, dropout=0.1)
NO_DROPOUT = LoraSpec(rank=4, alpha=8)


def _trainer(model_dir, spec=SPEC, micro_batch_size=2) -> Trainer:
    return comparison_trainer(model_dir, spec, micro_batch_size=micro_batch_size)


def _assert_states_match(serial: Trainer, fused: Trainer, tenants) -> None:
    assert_states_close(serial, fused, tenants, REL_TOL)


def _run(model_dir, tenants: list[str], groups: list[list[str]], steps: int, max_tenants: int, spec=SPEC,
         **fused_kw):
    data = mixed_work()
    serial, fused = _trainer(model_dir, spec), _trainer(model_dir, spec)
    ft = FusedTrainer(fused, max_tenants, backend="torch", **fused_kw)
    for i, t in enumerate(tenants):
        serial.store.register(t, seed=100 + i)
        fused.store.register(t, seed=100 + i)
    for _ in range(steps):
        for group in groups:
            for t in group:
                serial.train_step(t, data[t][0], data[t][1])
            res = ft.train_step([TenantWork(t, *data[t]) for t in group])
            assert sorted(r.tenant for r in res.results) == sorted(group)
    ft.flush()
    return serial, fused, ft


@pytest.mark.parametrize("spec", [SPEC, NO_DROPOUT], ids=["dropout", "bucketed"])
@pytest.mark.parametrize("tenants", [["acme", "beta"], ["gamma"], ["delta", "eps", "zeta"]], ids=["sft", "dpo", "rl"])
def test_fused_step_equals_solo_steps(tiny_model_dir, tenants, spec):
    serial, fused, _ = _run(tiny_model_dir, tenants, [tenants], steps=3, max_tenants=len(tenants) + 1, spec=spec)
    _assert_states_match(serial, fused, tenants)


@pytest.mark.parametrize("spec", [SPEC, NO_DROPOUT], ids=["dropout", "bucketed"])
def test_mixed_algorithms_in_one_fused_step_equal_solo_steps(tiny_model_dir, spec):
    tenants = ["acme", "beta", "gamma", "delta", "eps", "zeta"]
    serial, fused, ft = _run(tiny_model_dir, tenants, [tenants], steps=2, max_tenants=6, spec=spec)
    _assert_states_match(serial, fused, tenants)
    assert fused.store.stats.swaps == 0  # the fused path never went through the serial slots


def test_bucketed_step_splits_into_chunks_and_still_equals_solo_steps(tiny_model_dir):
    """A small chunk budget forces several forwards per step, mixing tenants' micro-batches
    (acme has 2 micro-batches of 2, beta 2 of 2 and 1): the per-sequence weights still give
    each tenant exactly its serial objective, and the padding stays within the bound."""
    tenants = ["acme", "beta", "delta"]
    data = mixed_work()
    serial, fused = _trainer(tiny_model_dir, NO_DROPOUT), _trainer(tiny_model_dir, NO_DROPOUT)
    ft = FusedTrainer(fused, 3, backend="torch", max_chunk_tokens=40, max_padding=0.1)
    for i, t in enumerate(tenants):
        serial.store.register(t, seed=100 + i)
        fused.store.register(t, seed=100 + i)
    for _ in range(2):
        want = {t: serial.train_step(t, *data[t]) for t in tenants}
        res = ft.train_step([TenantWork(t, *data[t]) for t in tenants])
        assert res.chunks >= 4  # 11 sequences cannot share one 40-token forward
        assert res.padded_tokens <= 1.1 * res.real_tokens
        for r in res.results:  # the reported loss and tokens are the serial step's
            assert r.loss == pytest.approx(want[r.tenant].loss, rel=1e-4) and r.tokens == want[r.tenant].tokens
    ft.flush()
    _assert_states_match(serial, fused, tenants)


def test_bucketing_equals_one_unbucketed_forward(tiny_model_dir):
    """The same fused step with everything in one forward padded to the widest, logits at every
    position (the layout before bucketing), and bucketed into small chunks with the LM head on
    target positions only: same losses, same states."""
    tenants = ["acme", "beta", "delta", "eps"]
    data = mixed_work()
    outs = []
    for kw in (dict(max_chunk_tokens=10**6, max_padding=10.0), dict(max_chunk_tokens=32, max_padding=0.0)):
        tr = _trainer(tiny_model_dir, NO_DROPOUT)
        ft = FusedTrainer(tr, 4, backend="torch", **kw)
        assert ft._head is not None  # the tiny Llama's logits are lm_head(hidden states)
        if kw["max_padding"] > 1:
            ft._head = None  # full logits through the model's own forward
        for i, t in enumerate(tenants):
            tr.store.register(t, seed=100 + i)
        res = ft.train_step([TenantWork(t, *data[t]) for t in tenants])
        ft.flush()
        outs.append((tr, res))
    (one, one_res), (bucketed, bucketed_res) = outs
    assert one_res.chunks == 2 and bucketed_res.chunks > 4  # one forward per algorithm vs many
    assert bucketed_res.padded_tokens < one_res.padded_tokens
    for a, b in zip(one_res.results, bucketed_res.results):
        assert a.tenant == b.tenant and a.loss == pytest.approx(b.loss, rel=1e-5) and a.tokens == b.tokens
    _assert_states_match(one, bucketed, tenants)


def test_tenants_beyond_k_swap_through_the_store_and_stay_equal(tiny_model_dir):
    """K = 2 fused slots, 4 tenants in changing pairs: evicted tenants are written back and
    reloaded, and every tenant still ends as if trained alone."""
    tenants = ["acme", "beta", "delta", "gamma"]
    groups = [["acme", "beta"], ["delta", "gamma"], ["gamma", "acme"], ["beta", "delta"]]
    serial, fused, ft = _run(tiny_model_dir, tenants, groups, steps=2, max_tenants=2)
    _assert_states_match(serial, fused, tenants)
    with pytest.raises(FusedCapacityError, match="3 tenants asked for one fused step but only 2 fused slots"):
        ft.train_step([TenantWork(t, *mixed_work()[t]) for t in ["acme", "beta", "delta"]])


def test_fused_state_is_what_the_store_serves_after_flush(tiny_model_dir):
    """Serial and fused paths share one store: evaluating a fused-trained tenant through the
    serial path, then training it fused again, never resurrects a stale copy."""
    data = mixed_work()
    serial, fused = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    ft = FusedTrainer(fused, 2, backend="torch")
    for tr in (serial, fused):
        tr.store.register("acme", seed=1)
    for step in range(3):
        serial.train_step("acme", *data["acme"])
        ft.train_step([TenantWork("acme", *data["acme"])])
        ft.flush()
        want = serial.eval_loss("acme", data["acme"][0], data["acme"][1])
        got = fused.eval_loss("acme", data["acme"][0], data["acme"][1])  # activates acme in the serial slot
        assert got == pytest.approx(want, rel=1e-5)
    _assert_states_match(serial, fused, ["acme"])
    assert not torch.equal(fused.store.state("acme").buffer[MASTER], fused.store.register("fresh", seed=1).buffer[MASTER])


def test_chunking_defaults_follow_the_device(tiny_model_dir):
    """CPU: tight buckets (a padded token costs a real one's compute); the CUDA defaults are
    checked in test_cuda.py. Explicit settings win."""
    ft = FusedTrainer(_trainer(tiny_model_dir), 2, backend="torch")
    assert (ft.max_chunk_tokens, ft.max_padding) == (1024, 0.1)
    ft = FusedTrainer(_trainer(tiny_model_dir), 2, backend="torch", max_chunk_tokens=64, max_padding=0.5)
    assert (ft.max_chunk_tokens, ft.max_padding) == (64, 0.5)

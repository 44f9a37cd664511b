"""Swap invariant: swapping other tenants in and out between a tenant's steps changes nothing."""

from __future__ import annotations

import pytest
import torch

from clora.learner.adapter_store import (MASTER, AdapterCapacityError, AdapterStore,
                                         UnknownTenantError)
from clora.learner.batches import ChatEncoder
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainingPolicy

from .helpers import sft_set

POLICY = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)


def _trainer(tiny, prefetch: bool, spec=LoraSpec(rank=4, alpha=8, dropout=0.1)) -> Trainer:
    model, tok = tiny
    lm = LoraModel(model, spec)
    store = AdapterStore(lm, prefetch=prefetch)
    return Trainer(lm, ChatEncoder(tok, 64), store)


def _snapshot(store: AdapterStore, tenant: str):
    st = store.state(tenant)
    return st.buffer.clone(), st.step, st.rng_state.clone(), st.examples_seen


@pytest.mark.parametrize("prefetch", [False, True])
def test_tenant_trained_with_swaps_is_bit_identical_to_trained_alone(tiny_model_dir, prefetch):
    from clora.learner.base_model import load_base_model

    alone = _trainer(load_base_model(tiny_model_dir), prefetch)
    alone.store.register("acme", seed=11)
    for _ in range(3):
        alone.train_step("acme", sft_set("acme", "yes"), POLICY)
    expected = _snapshot(alone.store, "acme")

    mixed = _trainer(load_base_model(tiny_model_dir), prefetch)
    for t, seed in (("acme", 11), ("beta", 12), ("gamma", 13)):
        mixed.store.register(t, seed=seed)
    other = TrainingPolicy(algorithm="sft", learning_rate=5e-2, batch_size=4)
    for step in range(3):
        mixed.train_step("acme", sft_set("acme", "yes"), POLICY, prefetch="beta")
        mixed.train_step("beta", sft_set("beta", "no no"), other, prefetch="gamma")
        mixed.train_step("gamma", sft_set("gamma", "maybe"), other, prefetch="acme")
    got = _snapshot(mixed.store, "acme")

    assert got[1] == expected[1] == 3 and got[3] == expected[3]
    assert torch.equal(got[2], expected[2]), "RNG state differs"
    for row, name in enumerate(("master", "exp_avg", "exp_avg_sq", "grad")):
        assert torch.equal(got[0][row], expected[0][row]), f"{name} differs after interleaving"
    assert got[0][1].abs().sum() > 0  # the moments are real, not trivially equal zeros
    # ... and the others really trained (different weights from acme and from their init)
    assert not torch.equal(mixed.store.state("beta").buffer[MASTER], got[0][MASTER])
    assert mixed.store.stats.swaps >= 8
    if prefetch:
        assert mixed.store.stats.prefetch_hits >= 6


def test_new_tenants_start_pristine_from_their_own_seed(tiny):
    tr = _trainer(tiny, prefetch=True)
    a, b, a2 = (tr.store.register(t, seed=s) for t, s in (("a", 1), ("b", 2), ("a2", 1)))
    assert torch.equal(a.buffer, a2.buffer)
    assert not torch.equal(a.buffer[MASTER], b.buffer[MASTER])
    assert a.step == 0 and a.buffer[1:].abs().sum() == 0  # no moments, no grads
    tr.train_step("a", sft_set("a", "x"), POLICY)
    c = tr.store.register("c", seed=1)  # registered after another tenant trained: still pristine
    assert torch.equal(c.buffer, a2.buffer)


def test_exactly_one_tenant_resident_and_model_reads_it(tiny):
    tr = _trainer(tiny, prefetch=True)
    for t, s in (("a", 1), ("b", 2)):
        tr.store.register(t, seed=s)
    slot = tr.store.activate("a")
    assert tr.store.active_tenant == "a"
    assert tr.model.bank.params is slot.params
    a_ptr = slot.params[0][0].data_ptr()
    assert a_ptr == slot.master.data_ptr()  # parameters are views into the slot buffer
    assert slot.params[0][0].grad.data_ptr() == slot.grad.data_ptr()
    tr.store.activate("b")
    assert tr.store.active_tenant == "b"
    assert torch.equal(tr.store.active.master, tr.store.state("b").buffer[MASTER])


def test_capacity_error_quotes_registered_and_resident(tiny):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    per = AdapterStore(lm).bytes_per_tenant
    store = AdapterStore(lm, max_host_bytes=2 * per + 10)
    store.register("a", 1)
    store.register("b", 2)
    store.activate("a")
    with pytest.raises(AdapterCapacityError) as e:
        store.register("c", 3)
    msg = str(e.value)
    assert "2 tenants registered" in msg and f"{2 * per} B" in msg and "1 resident" in msg
    with pytest.raises(UnknownTenantError):
        store.activate("zzz")

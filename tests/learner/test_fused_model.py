"""Mixed-batch invariant of the fused model: a fused forward of tenants A + B gives, row for
row, what the model gives with A alone and with B alone (padding included)."""

from __future__ import annotations

import torch

from clora.kernels import TritonBackend
from clora.learner.adapter_store import MASTER, AdapterStore
from clora.learner.batches import ChatEncoder
from clora.learner.fused_batch import FusedBinding, fuse_token_batches
from clora.learner.fused_slots import FusedSlots
from clora.learner.lora import LoraModel, LoraSpec

from .helpers import sft


def _setup(tiny):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lm, prefetch=False)
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(("a", "b", "c")):
        st = store.register(t, seed=i)
        st.buffer[MASTER].copy_(torch.randn(lm.layout.numel, generator=g) * 0.1)  # B != 0: adapters matter
    enc = ChatEncoder(tok, 64)
    batches = {"a": enc.sft([sft("a", 0, "short?", "y")]),
               "b": enc.sft([sft("b", i, f"a longer question number {i}?", "longer answer") for i in range(2)])}
    return lm, store, batches


def _solo_logits(lm, store, tenant, batch):
    store.activate(tenant)
    with torch.no_grad():
        return lm(batch.input_ids, batch.attention_mask)


def _fused_logits(lm, store, batches, backend):
    slots = FusedSlots(lm.layout, 3, torch.device("cpu"))
    slots.assign(["a", "c"], store)  # a -> slot 0, c -> slot 1
    idx, _ = slots.assign(["b", "a"], store)  # a stays in slot 0, b takes the free slot 2
    rows, ids, att = fuse_token_batches(["b", "a"], idx, [batches["b"], batches["a"]], pad_id=0)
    lm.bank.fused = FusedBinding(slots.params, torch.full((3,), lm.spec.scaling), rows.segment_meta(ids.shape[1], 3, ids.device),
                                 backend, rows)
    try:
        with torch.no_grad():
            return rows, lm(ids, att)
    finally:
        lm.bank.fused = None


def test_fused_forward_of_two_tenants_equals_each_alone(tiny):
    lm, store, batches = _setup(tiny)
    from clora.kernels import TorchBackend

    rows, fused = _fused_logits(lm, store, batches, TorchBackend())
    assert rows.tenants == ("a", "b") and rows.slots == (0, 2)  # sorted by slot; slot 1 (c) has no rows
    with torch.no_grad(), lm.adapter_disabled():
        base = lm(batches["a"].input_ids, batches["a"].attention_mask)
    for n, t in enumerate(rows.tenants):
        solo = _solo_logits(lm, store, t, batches[t])  # (B_t, T_t, V)
        got = fused[rows.rows(n), : rows.widths[n]]
        real = batches[t].attention_mask.bool()
        torch.testing.assert_close(got[real], solo[real], rtol=1e-5, atol=1e-5)
    solo_a = _solo_logits(lm, store, "a", batches["a"])
    assert (solo_a - base).abs().max() > 1e-3  # the adapter changes the output: the check has teeth


def test_fused_forward_under_the_triton_interpreter_matches(tiny):
    """The same invariant with the Triton kernels (interpreted on CPU; on CUDA they compile)."""
    lm, store, batches = _setup(tiny)
    rows, fused = _fused_logits(lm, store, batches, TritonBackend(interpret=True))
    for n, t in enumerate(rows.tenants):
        solo = _solo_logits(lm, store, t, batches[t])
        real = batches[t].attention_mask.bool()
        torch.testing.assert_close(fused[rows.rows(n), : rows.widths[n]][real], solo[real], rtol=1e-4, atol=1e-4)

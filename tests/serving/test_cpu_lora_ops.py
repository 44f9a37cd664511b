"""clora's CPU LoRA ops equal vLLM's torch ops wherever those are right (rows with an adapter),
give exactly zero LoRA contribution for base rows (index -1), and cover both the gather path
(small batches) and the grouped path (prefill-sized batches)."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops.torch_ops import lora_ops as ref

from clora.serving import vllm_cpu_lora as ours

SLOTS, RANK, HIDDEN, OUT = 4, 8, 48, 80


def _case(rows: int, pattern: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g)
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=g)
    idx = {"one": torch.full((rows,), 2), "mixed": torch.randint(0, SLOTS, (rows,), generator=g),
           "with_base": torch.randint(-1, SLOTS, (rows,), generator=g)}[pattern]
    return x, a, b, idx


@pytest.mark.parametrize("rows", [1, 7, 32, 33, 300])
@pytest.mark.parametrize("pattern", ["one", "mixed", "with_base"])
def test_shrink_expand_match_reference(rows, pattern):
    x, a, b, idx = _case(rows, pattern)
    safe = idx.clamp(min=0)  # the reference is right for rows with an adapter
    y_ref, y = torch.zeros(rows, RANK), torch.zeros(rows, RANK)
    ref.bgmv_shrink(x, a, y_ref, safe, 0.5)
    ours.bgmv_shrink(x, a, y, idx, 0.5)
    base = idx < 0
    torch.testing.assert_close(y[~base], y_ref[~base], rtol=1e-5, atol=1e-5)
    assert torch.all(y[base] == 0)
    z_ref, z = torch.ones(rows, OUT + 4), torch.ones(rows, OUT + 4)
    ref.bgmv_expand_slice(y_ref, b, z_ref, safe, 2, OUT, True)
    ours.bgmv_expand_slice(y, b, z, idx, 2, OUT, True)
    torch.testing.assert_close(z[~base], z_ref[~base], rtol=1e-4, atol=1e-4)
    assert torch.all(z[base] == 1)  # base rows: nothing added
    e_ref, e = torch.zeros(rows, OUT), torch.zeros(rows, OUT)
    ref.bgmv_expand(y_ref, b, e_ref, safe, False)
    ours.bgmv_expand(y, b, e, idx, False)
    torch.testing.assert_close(e[~base], e_ref[~base], rtol=1e-4, atol=1e-4)


def test_sgmv_segments():
    x, a, _, _ = _case(10, "one")
    seg_idx, seg_len = torch.tensor([1, -1, 3]), torch.tensor([4, 3, 3])
    y = torch.zeros(10, RANK)
    ours.sgmv_shrink(x, a, y, None, seg_len, seg_idx, 3, 4, 10, 1.0)
    torch.testing.assert_close(y[:4], x[:4] @ a[1, 0].T)
    assert torch.all(y[4:7] == 0)
    torch.testing.assert_close(y[7:], x[7:] @ a[3, 0].T)


# --- add_lora_linear with one plan per step ---------------------------------------------------

SLICES = (80, 24, 24)  # a fused qkv-like layer: three outputs side by side


def _wrapper(idx: torch.Tensor):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    w = PunicaWrapperCPU(512, 8, "cpu")
    _route(w, idx)
    return w


def _route(w, idx: torch.Tensor) -> None:
    """What vLLM's update_metadata does to the row -> slot indices: an in-place write."""
    w._token_lora_indices[: idx.shape[0]].copy_(idx)
    w.indices_len[:] = [idx.shape[0]] * 4


def _linear_case(rows: int, pattern: str, seed: int = 0, used_rank: int = RANK):
    """Stacked weights as vLLM lays them out: adapters of rank `used_rank` zero-padded to RANK."""
    x, _, _, idx = _case(rows, pattern, seed)
    g = torch.Generator().manual_seed(seed + 1)
    a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g) for _ in SLICES)
    b = tuple(torch.randn(SLOTS, 1, n, RANK, generator=g) for n in SLICES)
    for ai, bi in zip(a, b):
        ai[:, :, used_rank:] = 0
        bi[..., used_rank:] = 0
    return x, a, b, idx


def _expected(y, x, a, b, idx, scale):
    """The definition, row by row: each slice adds scale * x A[s]^T B[s]^T; base rows get nothing."""
    y = y.clone()
    for t, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        off = 0
        for ai, bi, n in zip(a, b, SLICES):
            y[t, off: off + n] += scale * (x[t] @ ai[s, 0].T) @ bi[s, 0].T
            off += n
    return y


@pytest.mark.parametrize("rows", [1, 7, ours.DENSE_MAX_ROWS, ours.DENSE_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("pattern", ["one", "mixed", "with_base"])
@pytest.mark.parametrize("used_rank", [RANK, 5])
def test_add_lora_linear_matches_the_definition(rows, pattern, used_rank):
    x, a, b, idx = _linear_case(rows, pattern, used_rank=used_rank)
    y0 = torch.randn(rows, sum(SLICES))
    y = y0.clone()
    assert ours.add_lora_linear(_wrapper(idx), y, x, a, b, 0.5, SLICES) is None  # in place, as on CPU
    torch.testing.assert_close(y, _expected(y0, x, a, b, idx, 0.5), rtol=1e-4, atol=1e-4)
    assert torch.equal(y[idx < 0], y0[idx < 0])  # base rows untouched, exactly


def test_add_lora_linear_sees_new_indices_and_new_weights():
    x, a, b, idx = _linear_case(9, "mixed", seed=3)
    w = _wrapper(idx)
    y = torch.zeros(9, sum(SLICES))
    ours.add_lora_linear(w, y, x, a, b, 1.0, SLICES)
    # The next step routes the rows elsewhere (written in place, as vLLM does) ...
    idx2 = (idx + 1) % SLOTS
    _route(w, idx2)
    # ... and a slot gets a new adapter (vLLM copies it into the stacked weights).
    for bi in b:
        bi[idx2[0], 0].copy_(torch.randn_like(bi[idx2[0], 0]))
    y = torch.zeros(9, sum(SLICES))
    ours.add_lora_linear(w, y, x, a, b, 1.0, SLICES)
    torch.testing.assert_close(y, _expected(torch.zeros_like(y), x, a, b, idx2, 1.0), rtol=1e-4, atol=1e-4)


def test_logits_lora_is_skipped_only_while_every_slot_is_zero(monkeypatch):
    calls = []
    monkeypatch.setitem(ours._ORIGINAL, "add_lora_logits", lambda *args, **kw: calls.append(args))
    w = _wrapper(torch.tensor([0, 1]))
    a, b = torch.randn(SLOTS, 1, RANK, HIDDEN), torch.zeros(SLOTS, 1, 50, RANK)
    y = torch.ones(2, 50)
    ours.add_lora_logits(w, y, torch.randn(2, HIDDEN), a, b, 1.0)
    assert not calls and torch.all(y == 1)
    b[2, 0, 7, 3] = 0.5  # an adapter with an lm_head LoRA is loaded into slot 2 (in place)
    ours.add_lora_logits(w, y, torch.randn(2, HIDDEN), a, b, 1.0)
    assert len(calls) == 1

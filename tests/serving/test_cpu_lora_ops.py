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

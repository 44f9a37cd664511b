"""The pure-torch reference (the CPU path): gradcheck in float64 and plain-loop semantics."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_cases import adapter_ids, sorted_meta, stacked_adapters

from clora.kernels import SegmentMeta, TorchBackend, lora_expand, lora_shrink, segmented_lora
from clora.kernels.segmented_mm import segmented_mm_reference
from clora.kernels.segmented_weight_grad import segmented_weight_grad_reference


@pytest.mark.parametrize("pattern", ["uniform", "empty_segments", "identical"])
def test_segmented_lora_reference_passes_gradcheck(pattern):
    meta = sorted_meta(pattern, 11, 3, seed=1)
    a, b, scale = stacked_adapters([2, 4, 3], 5, 6, torch.float64)
    x = torch.randn(11, 5, dtype=torch.float64)
    inputs = (x.requires_grad_(), a.requires_grad_(), b.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda x, a, b: segmented_lora(x, a, b, scale, meta, TorchBackend()), inputs, eps=1e-6, atol=1e-7
    )


def test_shrink_and_expand_follow_their_semantics_row_by_row():
    ids = adapter_ids("uniform", 20, 3, seed=2)
    meta = SegmentMeta.from_token_adapter_ids(ids, 3)
    a, b, scale = stacked_adapters([4, 4, 2], 8, 6, torch.float64)
    x = meta.to_sorted(torch.randn(20, 8, dtype=torch.float64))
    y0 = torch.randn(20, 6, dtype=torch.float64)
    v = lora_shrink(x, a, meta, TorchBackend())
    y = lora_expand(y0.clone(), v, b, scale, meta, TorchBackend())
    sorted_ids = meta.to_sorted(ids)
    for row in range(20):
        slot = int(sorted_ids[row])
        if slot < 0:
            assert torch.all(v[row] == 0) and torch.equal(y[row], y0[row])
        else:
            torch.testing.assert_close(v[row], x[row] @ a[slot])
            torch.testing.assert_close(y[row], y0[row] + x[row] @ a[slot] @ b[slot] * scale[slot])


def test_weight_grad_reference_is_zero_for_empty_segments_and_scaled_outer_sum_otherwise():
    meta = SegmentMeta.from_token_adapter_ids([0, 0, 2, 2, 2, -1], 3)
    p = torch.randn(6, 4, dtype=torch.float64)
    q = torch.randn(6, 5, dtype=torch.float64)
    scale = torch.tensor([1.0, 7.0, 0.5])
    dw = segmented_weight_grad_reference(p, q, meta, scale)
    assert torch.all(dw[1] == 0)
    torch.testing.assert_close(dw[0], p[:2].T @ q[:2])
    torch.testing.assert_close(dw[2], p[2:5].T @ q[2:5] * 0.5)


def test_reference_rejects_shape_mismatches_with_context():
    meta = SegmentMeta.from_token_adapter_ids([0, 1], 2)
    with pytest.raises(ValueError, match="3 adapter slots|2 adapter slots"):
        segmented_mm_reference(torch.zeros(2, 4), torch.zeros(3, 4, 8), meta)
    with pytest.raises(ValueError, match="scale must have shape"):
        segmented_mm_reference(torch.zeros(2, 4), torch.zeros(2, 4, 8), meta, scale=torch.ones(3))
    with pytest.raises(TypeError, match="share a dtype"):
        segmented_lora(torch.zeros(2, 4), torch.zeros(2, 4, 8, dtype=torch.float64), torch.zeros(2, 8, 3),
                       torch.ones(2), meta, TorchBackend())

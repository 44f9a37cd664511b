"""SegmentMeta: the documented worked example, constructors, round trips and bad input."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_cases import PATTERNS, adapter_ids

from clora.kernels import SegmentMeta


def test_worked_example_from_the_docstring():
    meta = SegmentMeta.from_token_adapter_ids([2, -1, 0, 2, 0, 4, 2], num_adapters=5)
    assert meta.token_order.tolist() == [2, 4, 0, 3, 6, 5, 1]
    assert meta.inverse_order.tolist() == [2, 6, 0, 3, 1, 5, 4]
    assert meta.seg_starts.tolist() == [0, 2, 2, 5, 5, 6]
    assert meta.seg_starts.dtype == torch.int32
    assert meta.starts == (0, 2, 2, 5, 5, 6)
    assert (meta.max_seg_len, meta.num_adapters, meta.num_tokens, meta.num_lora_tokens) == (3, 5, 7, 6)
    assert meta.is_sorted is False
    assert meta.segment(2) == slice(2, 5)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_sorting_groups_each_adapter_and_round_trips(pattern):
    ids = adapter_ids(pattern, 37, 5, seed=3)
    meta = SegmentMeta.from_token_adapter_ids(ids, 5)
    sorted_ids = meta.to_sorted(ids)
    for slot in range(5):
        seg = sorted_ids[meta.segment(slot)]
        assert torch.all(seg == slot)
        assert len(seg) == int((ids == slot).sum())
    assert torch.all(sorted_ids[meta.num_lora_tokens :] == -1)
    x = torch.randn(37, 3)
    assert torch.equal(meta.to_batch_order(meta.to_sorted(x)), x)


def test_from_seq_lens_expands_sequences_and_detects_sorted_batches():
    meta = SegmentMeta.from_seq_lens([1, 0, 1], [3, 2, 4], num_adapters=2)
    assert meta.starts == (0, 2, 9)
    assert meta.token_order.tolist() == [3, 4, 0, 1, 2, 5, 6, 7, 8]
    assert not meta.is_sorted
    grouped = SegmentMeta.from_seq_lens([0, 1, 1, -1], [2, 3, 1, 2], num_adapters=3)
    assert grouped.is_sorted
    assert grouped.starts == (0, 2, 6, 6)
    x = torch.randn(8, 4)
    assert grouped.to_sorted(x) is x  # no gather for an already-sorted batch


def test_all_base_only_and_empty_batches():
    base = SegmentMeta.from_token_adapter_ids([-1, -1, -1], 2)
    assert base.starts == (0, 0, 0) and base.max_seg_len == 0 and base.num_lora_tokens == 0
    empty = SegmentMeta.from_token_adapter_ids(torch.empty(0, dtype=torch.int64), 2)
    assert empty.num_tokens == 0 and empty.starts == (0, 0, 0)


@pytest.mark.parametrize(
    ("ids", "num_adapters", "match"),
    [([0, 3], 3, r"\[-1, 3\).*\[3\]"), ([-2, 0], 3, r"\[-2\]"), ([[0, 1]], 3, "1-D"), ([0], 0, "num_adapters")],
)
def test_bad_adapter_ids_are_rejected_with_context(ids, num_adapters, match):
    with pytest.raises(ValueError, match=match):
        SegmentMeta.from_token_adapter_ids(ids, num_adapters)


def test_mismatched_sequence_lists_and_row_counts_are_rejected():
    with pytest.raises(ValueError, match="2 sequence adapter ids but 1"):
        SegmentMeta.from_seq_lens([0, 1], [3], num_adapters=2)
    meta = SegmentMeta.from_token_adapter_ids([0, 1], 2)
    with pytest.raises(ValueError, match="3 token rows .* describes 2"):
        meta.to_sorted(torch.zeros(3, 4))

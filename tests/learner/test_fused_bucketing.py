"""Length bucketing of a fused step (`plan_chunks`) and packing of chunks (`pack_blocks`)."""

from __future__ import annotations

import random

import pytest
import torch

from clora.learner.batches import TokenBatch
from clora.learner.fused_batch import pack_blocks, plan_chunks


def _padded(chunk, rows, widths) -> tuple[int, int]:
    """(padded tokens, tokens the units need alone) of one chunk."""
    return sum(rows[i] for i in chunk) * max(widths[i] for i in chunk), sum(rows[i] * widths[i] for i in chunk)


def test_one_long_and_many_short_sequences_do_not_pad_the_short_ones():
    """Padding every row to the widest (what one fused forward over all rows would do) costs
    512 * 17 = 8704 tokens for 1,264 real; bucketed, the long row runs alone."""
    widths = [20] * 8 + [500] + [24] * 8
    rows = [1] * len(widths)
    chunks = plan_chunks(rows, widths, max_tokens=4096, max_padding=0.25)
    assert [8] in chunks  # the long one alone
    padded = sum(_padded(c, rows, widths)[0] for c in chunks)
    assert padded <= 1.25 * sum(widths)
    assert sorted(i for c in chunks for i in c) == list(range(len(widths)))


@pytest.mark.parametrize("seed", range(5))
def test_chunks_respect_the_padding_and_token_bounds(seed):
    g = random.Random(seed)
    n = 60
    widths = [g.randint(5, 300) for _ in range(n)]
    rows = [g.choice([1, 1, 2, 4]) for _ in range(n)]
    chunks = plan_chunks(rows, widths, max_tokens=1024, max_padding=0.1)
    assert sorted(i for c in chunks for i in c) == list(range(n))  # every unit exactly once
    padded, own = (sum(x) for x in zip(*(_padded(c, rows, widths) for c in chunks)))
    assert own == sum(r * w for r, w in zip(rows, widths)) and padded <= 1.1 * own
    for c in chunks:
        assert _padded(c, rows, widths)[0] <= 1024 or len(c) == 1  # only a unit over the budget alone


def test_a_bucket_over_the_budget_is_split_evenly():
    assert [len(c) for c in plan_chunks([1] * 8, [142] * 8, 1024, 0.1)] == [4, 4]  # 7 fit: not 7 + 1
    assert [len(c) for c in plan_chunks([1] * 32, [142] * 32, 1024, 0.1)] == [7, 7, 6, 6, 6]
    assert plan_chunks([3, 2, 5], [100] * 3, 250, 0.1) == [[0], [1], [2]]  # a 5-row unit alone


def test_rounds_keep_their_order_and_never_share_a_chunk():
    widths = [10, 50, 10, 50, 12, 48]
    rounds = [0, 0, 1, 1, 2, 2]
    chunks = plan_chunks([1] * 6, widths, max_tokens=1000, max_padding=10.0, rounds=rounds)
    assert chunks == [[1, 0], [3, 2], [5, 4]]
    assert plan_chunks([1] * 6, widths, max_tokens=1000, max_padding=10.0) == [[1, 3, 5, 4, 0, 2]]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="one row count, width"):
        plan_chunks([1, 1], [3], 10, 0.1)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        plan_chunks([1], [3], 0, 0.1)


def _block(lengths: list[int], behaviour: bool = False, start: int = 1) -> TokenBatch:
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    att = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(start, start + n)
        att[i, :n] = 1
    mask = att[:, 1:].float()
    return TokenBatch(ids, att, mask, mask * -0.5 if behaviour else None)


def test_pack_blocks_groups_a_tenants_adjacent_blocks_and_pads_to_the_widest():
    rows, batch = pack_blocks(["a", "a", "b"], [0, 0, 2], [_block([3]), _block([5, 2]), _block([4], behaviour=True)],
                              pad_id=-1)
    assert rows.tenants == ("a", "b") and rows.slots == (0, 2) and rows.row_starts == (0, 3, 4)
    assert rows.widths == (5, 4)  # a's widest own block, b's block
    assert batch.input_ids.shape == (4, 5)
    assert batch.input_ids[0].tolist() == [1, 2, 3, -1, -1] and batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert batch.loss_mask.sum().item() == 2 + 4 + 1 + 3
    # a's blocks served none: NaN on their target tokens (the current policy stands in), 0 elsewhere
    assert torch.equal(torch.isnan(batch.behaviour_logprobs[:3]), batch.loss_mask[:3] > 0)
    assert batch.behaviour_logprobs[:3].nan_to_num().abs().sum() == 0 and batch.behaviour_logprobs[3].sum() == -1.5
    meta = rows.segment_meta(5, 3, torch.device("cpu"))
    assert meta.is_sorted and meta.starts == (0, 15, 15, 20)
    with pytest.raises(ValueError, match="ascending slot order"):
        pack_blocks(["b", "a"], [2, 0], [_block([3]), _block([3])], pad_id=0)
    with pytest.raises(ValueError, match="adjacent"):
        pack_blocks(["a", "b", "a"], [0, 1, 1], [_block([3])] * 3, pad_id=0)

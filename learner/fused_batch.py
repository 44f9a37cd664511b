"""Fused token batches: which rows belong to which tenant, how a fused step's sequences are
cut into length buckets, and the LoRA binding that reads a fused batch.

Owns `FusedRows` (which rows belong to which tenant, and how wide each tenant's own block
was), `plan_chunks` (length bucketing: which sequences share one forward), `pack_blocks` /
`fuse_token_batches` (right-pad and stack blocks of rows, grouped by ascending slot) and
`FusedBinding`: what every `LoraLinear` calls in fused mode. Its `delta` applies, to each
row, the LoRA adapter of that row's tenant with the segmented kernels of `clora.kernels`:

    y[t] = base(x[t]) + x[t] @ A[slot(t)]^T @ B[slot(t)]^T * alpha / rank

Because rows are grouped by ascending slot, the tokens are already sorted by adapter
(`SegmentMeta.is_sorted`), so no gather happens before or after the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from clora.kernels import SegmentedBackend, SegmentMeta, segmented_lora
from clora.learner.batches import TokenBatch
from clora.learner.lora import dropout_keep


@dataclass(frozen=True)
class FusedRows:
    """Layout of a fused batch: group n (one tenant) owns rows `row_starts[n]:row_starts[n+1]`.

    Worked example, 3 fused slots: "acme" in slot 0 with 2 sequences of width 5, "beta" in
    slot 2 with 1 sequence of width 7 (slot 1 holds nobody in this step):
      tenants ("acme", "beta"), slots (0, 2), row_starts (0, 2, 3), widths (5, 7)
      -> the fused input_ids is (3, 7): acme's rows 0-1 are right-padded by 2 tokens;
         `row_slots` is (0, 0, 2) and the SegmentMeta over its 21 tokens has
         seg_starts [0, 14, 14, 21] (slot 1's segment is empty).
    Padding tokens carry their row's slot; they are masked out of attention and loss, so they
    receive exactly zero gradient. `widths[n]` is the width of group n's own block (the widest
    of its rows before fusing): LoRA dropout draws its masks in that shape, as a solo step does.
    """

    tenants: tuple[str, ...]
    slots: tuple[int, ...]  # ascending
    row_starts: tuple[int, ...]  # (len(tenants) + 1,)
    widths: tuple[int, ...]  # each group's own block width T_n (before fusing)

    def rows(self, n: int) -> slice:
        return slice(self.row_starts[n], self.row_starts[n + 1])

    @property
    def row_slots(self) -> tuple[int, ...]:
        return tuple(s for n, s in enumerate(self.slots) for _ in range(self.row_starts[n + 1] - self.row_starts[n]))

    def segment_meta(self, width: int, num_slots: int, device: torch.device) -> SegmentMeta:
        """Segments over the fused batch's `rows * width` tokens (row-major, as the model flattens)."""
        row_slots = self.row_slots
        return SegmentMeta.from_seq_lens(row_slots, [width] * len(row_slots), num_slots, device=device)


def plan_chunks(rows: Sequence[int], widths: Sequence[int], max_tokens: int, max_padding: float,
                rounds: Sequence[int] | None = None) -> list[list[int]]:
    """Length bucketing: cut units (unit i = `rows[i]` sequences of padded width `widths[i]`,
    always kept together) into chunks, each run as one forward padded to its widest unit.

    1. Buckets: within each round (all units in one round when `rounds` is None), units are
       taken widest first; a bucket grows while
           bucket_rows * bucket_width <= (1 + max_padding) * sum_i rows_i * widths_i
       so bucketing adds at most `max_padding` of padding over what each unit needs alone.
    2. Chunks: a bucket over `max_tokens` padded tokens is split, in order, into the fewest
       chunks of at most max_tokens // bucket_width rows, filled evenly (8 rows that fit 7 to
       a chunk give 4 + 4, not 7 + 1). A unit wider than max_tokens gets a chunk of its own.
    Every chunk of round j comes before every chunk of round j + 1. Returns chunks as lists
    of unit indices.

    Example: widths [30, 8, 9, 31, 7], one row each, max_tokens 64, max_padding 0.25
      -> buckets [3, 0] (2 x 31 = 62 tokens for 61 real) and [2, 1, 4] (3 x 9 = 27 for 24);
         both fit 64 tokens, so they are the chunks.
    """
    if not (len(rows) == len(widths)) or (rounds is not None and len(rounds) != len(rows)):
        raise ValueError(f"plan_chunks needs one row count, width (and round) per unit, got "
                         f"{len(rows)}, {len(widths)}, {len(rounds) if rounds is not None else '-'}")
    if max_tokens < 1 or max_padding < 0:
        raise ValueError(f"plan_chunks needs max_tokens >= 1 and max_padding >= 0, got {max_tokens}, {max_padding}")
    order = sorted(range(len(rows)), key=lambda i: (rounds[i] if rounds is not None else 0, -widths[i], i))
    buckets: list[list[int]] = []
    bucket_round, width, n_rows, own = None, 0, 0, 0
    for i in order:
        r = rounds[i] if rounds is not None else 0
        area = rows[i] * widths[i]
        if buckets and r == bucket_round and (n_rows + rows[i]) * width <= (1 + max_padding) * (own + area):
            buckets[-1].append(i)
            n_rows, own = n_rows + rows[i], own + area
        else:
            buckets.append([i])
            bucket_round, width, n_rows, own = r, widths[i], rows[i], area
    chunks: list[list[int]] = []
    for bucket in buckets:
        cap = max(1, max_tokens // widths[bucket[0]])  # rows per chunk at the bucket's width
        left = sum(rows[i] for i in bucket)
        left_chunks = -(-left // cap)
        target, chunk_rows = min(cap, -(-left // left_chunks)), None
        for i in bucket:
            if chunk_rows is not None and chunk_rows + rows[i] <= target:
                chunks[-1].append(i)
                chunk_rows += rows[i]
                continue
            if chunk_rows is not None:  # close the chunk: spread what is left over the chunks left
                left, left_chunks = left - chunk_rows, max(1, left_chunks - 1)
                target = min(cap, -(-left // left_chunks))
            chunks.append([i])
            chunk_rows = rows[i]
    return chunks


def stack_blocks(blocks: Sequence[TokenBatch], pad_id: int) -> TokenBatch:
    """Blocks of rows stacked in order, right-padded to the widest: input_ids / attention_mask
    (R, T), loss_mask (R, T-1), and behaviour_logprobs, advantages and weights (R, T-1; zeros
    for blocks without them, but behaviour_logprobs NaN on such a block's target tokens: the
    current policy stands in there, `losses.behaviour_or_current`) or None when no block has them."""
    if not blocks:
        raise ValueError("stack_blocks got no blocks")
    width = max(b.input_ids.shape[1] for b in blocks)
    total = sum(b.input_ids.shape[0] for b in blocks)
    ids = torch.full((total, width), pad_id, dtype=torch.long)
    att = torch.zeros((total, width), dtype=torch.long)
    mask = torch.zeros((total, width - 1), dtype=torch.float32)
    per_token = {name: (torch.zeros((total, width - 1), dtype=torch.float32)
                        if any(getattr(b, name) is not None for b in blocks) else None)
                 for name in ("behaviour_logprobs", "advantages", "weights")}
    row = 0
    for b in blocks:
        n, w = b.input_ids.shape
        ids[row:row + n, :w] = b.input_ids
        att[row:row + n, :w] = b.attention_mask
        mask[row:row + n, :w - 1] = b.loss_mask
        for name, out in per_token.items():
            if out is not None and getattr(b, name) is not None:
                out[row:row + n, :w - 1] = getattr(b, name)
            elif out is not None and name == "behaviour_logprobs":
                out[row:row + n, :w - 1] = torch.where(b.loss_mask > 0, float("nan"), 0.0)
        row += n
    return TokenBatch(ids, att, mask, **per_token)


def pack_blocks(tenants: Sequence[str], slots: Sequence[int], blocks: Sequence[TokenBatch],
                pad_id: int) -> tuple[FusedRows, TokenBatch]:
    """Stack blocks of rows (block k: rows of tenant `tenants[k]` in slot `slots[k]`, given in
    ascending slot order, a tenant's blocks adjacent) into one batch (`stack_blocks`).

    Adjacent blocks of one tenant form one group of the returned `FusedRows`.
    """
    if not (len(tenants) == len(slots) == len(blocks)) or not blocks:
        raise ValueError(f"need one slot and one block per tenant, got {len(tenants)} tenants, "
                         f"{len(slots)} slots, {len(blocks)} blocks")
    if any(b < a for a, b in zip(slots, slots[1:])):
        raise ValueError(f"blocks must come in ascending slot order, got slots {list(slots)}")
    names: list[str] = []
    group_slots: list[int] = []
    starts, widths = [0], []
    for tenant, slot, b in zip(tenants, slots, blocks):
        n, w = b.input_ids.shape
        if names and names[-1] == tenant:
            starts[-1], widths[-1] = starts[-1] + n, max(widths[-1], w)
            continue
        if tenant in names or slot in group_slots:
            raise ValueError(f"each tenant's blocks must be adjacent and in a slot of their own "
                             f"(tenants {list(tenants)}, slots {list(slots)})")
        names.append(tenant)
        group_slots.append(slot)
        starts.append(starts[-1] + n)
        widths.append(w)
    rows = FusedRows(tuple(names), tuple(group_slots), tuple(starts), tuple(widths))
    return rows, stack_blocks(blocks, pad_id)


def fuse_token_batches(tenants: list[str], slots: list[int], batches: list[TokenBatch],
                       pad_id: int) -> tuple[FusedRows, torch.Tensor, torch.Tensor]:
    """Stack one batch per tenant, right-padded to the widest, sorted by slot.

    Returns (rows, input_ids (R, T) int64, attention_mask (R, T) int64), R = total rows.
    """
    if not (len(tenants) == len(slots) == len(batches)) or not tenants:
        raise ValueError(f"need one slot and one batch per tenant, got {len(tenants)} tenants, "
                         f"{len(slots)} slots, {len(batches)} batches")
    order = sorted(range(len(tenants)), key=lambda n: slots[n])
    rows, batch = pack_blocks([tenants[n] for n in order], [slots[n] for n in order], [batches[n] for n in order],
                              pad_id)
    return rows, batch.input_ids, batch.attention_mask


@dataclass(frozen=True)
class FusedBinding:
    """What the LoRA wrappers read during one fused forward (set on `LoraBank.fused`)."""

    params: list[tuple[torch.Tensor, torch.Tensor]]  # per site: A (K, r, in), B (K, out, r)
    scale: torch.Tensor  # (K,) fp32, alpha / rank
    meta: SegmentMeta  # over the fused batch's R * T tokens
    backend: SegmentedBackend
    rows: FusedRows
    dropout: float = 0.0
    generators: tuple[torch.Generator, ...] = ()
    """Per tenant (in `rows` order): its own RNG, so LoRA dropout draws exactly as in a solo step."""

    def delta(self, index: int, x: torch.Tensor, training: bool) -> torch.Tensor:
        """The LoRA update of site `index` for x (R, T, in) -> (R, T, out)."""
        a, b = self.params[index]  # (K, r, in), (K, out, r)
        if x.dim() != 3 or x.shape[0] * x.shape[1] != self.meta.num_tokens:
            raise ValueError(f"fused LoRA site {index} got input {tuple(x.shape)}; the fused batch has "
                             f"{self.meta.num_tokens} tokens in {self.rows.row_starts[-1]} rows")
        if self.dropout > 0 and training:
            x = self._dropout(x)
        x = x.to(a.dtype)
        tokens = x.reshape(-1, x.shape[-1])  # (R*T, in), sorted by slot
        out = segmented_lora(self.meta.to_sorted(tokens), a.transpose(1, 2), b.transpose(1, 2),
                             self.scale, self.meta, self.backend)  # (R*T, out)
        return self.meta.to_batch_order(out).reshape(x.shape[0], x.shape[1], -1)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Each tenant's rows draw their mask from the tenant's generator with the shape of its
        own batch (B_n, T_n, in), exactly as `LoraLinear` does in a solo step."""
        p, out = self.dropout, x.clone()
        for n, gen in enumerate(self.generators):
            part = x[self.rows.rows(n), : self.rows.widths[n]]  # (B_n, T_n, in)
            keep = dropout_keep(part.shape, p, gen, x.device)
            out[self.rows.rows(n), : self.rows.widths[n]] = part * keep / (1 - p)
        return out

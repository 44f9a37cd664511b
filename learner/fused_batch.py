"""One token batch holding several tenants' micro-batches, and the LoRA binding that reads it.

Owns `FusedRows` (which rows belong to which tenant, and how wide each tenant's own batch
was), `fuse_token_batches` (right-pad and stack the tenants' batches, sorted by slot), and
`FusedBinding`: what every `LoraLinear` calls in fused mode. Its `delta` applies, to each
row, the LoRA adapter of that row's tenant with the segmented kernels of `clora.kernels`:

    y[t] = base(x[t]) + x[t] @ A[slot(t)]^T @ B[slot(t)]^T * alpha / rank

Because rows are grouped by ascending slot, the tokens are already sorted by adapter
(`SegmentMeta.is_sorted`), so no gather happens before or after the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clora.kernels import SegmentedBackend, SegmentMeta, segmented_lora
from clora.learner.batches import TokenBatch


@dataclass(frozen=True)
class FusedRows:
    """Layout of a fused batch: tenant n owns rows `row_starts[n]:row_starts[n+1]`.

    Worked example, 3 fused slots: "acme" in slot 0 with 2 sequences of width 5, "beta" in
    slot 2 with 1 sequence of width 7 (slot 1 holds nobody in this step):
      tenants ("acme", "beta"), slots (0, 2), row_starts (0, 2, 3), widths (5, 7)
      -> the fused input_ids is (3, 7): acme's rows 0-1 are right-padded by 2 tokens;
         `row_slots` is (0, 0, 2) and the SegmentMeta over its 21 tokens has
         seg_starts [0, 14, 14, 21] (slot 1's segment is empty).
    Padding tokens carry their row's slot; they are masked out of attention and loss, so they
    receive exactly zero gradient.
    """

    tenants: tuple[str, ...]
    slots: tuple[int, ...]  # ascending
    row_starts: tuple[int, ...]  # (len(tenants) + 1,)
    widths: tuple[int, ...]  # each tenant's own batch width T_n (before fusing)

    def rows(self, n: int) -> slice:
        return slice(self.row_starts[n], self.row_starts[n + 1])

    @property
    def row_slots(self) -> tuple[int, ...]:
        return tuple(s for n, s in enumerate(self.slots) for _ in range(self.row_starts[n + 1] - self.row_starts[n]))

    def segment_meta(self, width: int, num_slots: int, device: torch.device) -> SegmentMeta:
        """Segments over the fused batch's `rows * width` tokens (row-major, as the model flattens)."""
        row_slots = self.row_slots
        return SegmentMeta.from_seq_lens(row_slots, [width] * len(row_slots), num_slots, device=device)

    def tenant_view(self, n: int, per_token: torch.Tensor) -> torch.Tensor:
        """Tenant n's part of a (rows, T-1) per-position tensor, cut back to its own (B_n, T_n - 1)."""
        return per_token[self.rows(n), : self.widths[n] - 1]


def fuse_token_batches(tenants: list[str], slots: list[int], batches: list[TokenBatch],
                       pad_id: int) -> tuple[FusedRows, torch.Tensor, torch.Tensor]:
    """Stack the tenants' batches, right-padded to the widest, sorted by slot.

    Returns (rows, input_ids (R, T) int64, attention_mask (R, T) int64), R = total rows.
    """
    if not (len(tenants) == len(slots) == len(batches)) or not tenants:
        raise ValueError(f"need one slot and one batch per tenant, got {len(tenants)} tenants, "
                         f"{len(slots)} slots, {len(batches)} batches")
    order = sorted(range(len(tenants)), key=lambda n: slots[n])
    width = max(b.input_ids.shape[1] for b in batches)
    ids, att, starts = [], [], [0]
    for n in order:
        b = batches[n]
        pad = width - b.input_ids.shape[1]
        ids.append(torch.nn.functional.pad(b.input_ids, (0, pad), value=pad_id))
        att.append(torch.nn.functional.pad(b.attention_mask, (0, pad), value=0))
        starts.append(starts[-1] + b.input_ids.shape[0])
    rows = FusedRows(tuple(tenants[n] for n in order), tuple(slots[n] for n in order), tuple(starts),
                     tuple(batches[n].input_ids.shape[1] for n in order))
    return rows, torch.cat(ids), torch.cat(att)


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
            keep = torch.rand(part.shape, generator=gen, device=x.device) >= p
            out[self.rows.rows(n), : self.rows.widths[n]] = part * keep / (1 - p)
        return out

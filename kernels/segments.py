"""Segment metadata for multi-LoRA batches: which sorted token rows belong to which adapter.

The segmented kernels work on tokens *sorted by adapter slot*, so that every adapter's
tokens form one contiguous run of rows (a segment). `SegmentMeta` is the one object that
describes that layout; it is built once per batch and shared by every LoRA layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BASE_ONLY = -1
"""Adapter id of a token that gets no LoRA contribution (the base model only)."""


@dataclass(frozen=True)
class SegmentMeta:
    """Layout of a batch of tokens sorted by adapter slot.

    Worked example: five adapter slots, per-token adapter ids (in batch order)
    `[2, -1, 0, 2, 0, 4, 2]` (token 1 is base-only; slots 1 and 3 are unused).

    - `token_order` is `[2, 4, 0, 3, 6, 5, 1]`: sorted row r holds batch token
      `token_order[r]` (a stable sort, so tokens keep their order within a segment).
    - `inverse_order` is `[2, 6, 0, 3, 1, 5, 4]`: batch token j sits at sorted row
      `inverse_order[j]`.
    - `seg_starts` is `[0, 2, 2, 5, 5, 6]`: adapter slot i owns sorted rows
      `seg_starts[i]:seg_starts[i+1]` (slot 0 rows 0-1, slot 1 empty, slot 2 rows 2-4,
      slot 3 empty, slot 4 row 5). Rows from `seg_starts[-1]` (here 6) to `num_tokens`
      (here 7) are base-only and get no LoRA contribution.
    - `max_seg_len` is 3, `num_adapters` 5, `num_tokens` 7, `is_sorted` False.

    Tensors live on the device of the batch; `starts` repeats `seg_starts` on the host
    so that launch grids and the torch reference need no device synchronisation.
    """

    seg_starts: torch.Tensor  # (num_adapters + 1,) int32, on the batch device
    token_order: torch.Tensor  # (num_tokens,) int64: sorted row -> batch token
    inverse_order: torch.Tensor  # (num_tokens,) int64: batch token -> sorted row
    starts: tuple[int, ...]  # host copy of seg_starts
    num_tokens: int
    max_seg_len: int
    is_sorted: bool  # True when token_order is the identity (no gather needed)

    @property
    def num_adapters(self) -> int:
        return len(self.starts) - 1

    @property
    def num_lora_tokens(self) -> int:
        """Tokens that belong to some adapter (the rest are base-only)."""
        return self.starts[-1]

    def segment(self, slot: int) -> slice:
        """The sorted rows of adapter `slot`."""
        return slice(self.starts[slot], self.starts[slot + 1])

    def to_sorted(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of `x` (num_tokens, ...) in batch order -> sorted order."""
        self._check_rows(x)
        return x if self.is_sorted else x.index_select(0, self.token_order)

    def to_batch_order(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of `x` (num_tokens, ...) in sorted order -> batch order."""
        self._check_rows(x)
        return x if self.is_sorted else x.index_select(0, self.inverse_order)

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise ValueError(
                f"tensor has {x.shape[0]} token rows but the SegmentMeta describes {self.num_tokens}"
            )

    @classmethod
    def from_token_adapter_ids(
        cls, adapter_ids: torch.Tensor | Sequence[int], num_adapters: int, device: torch.device | str | None = None
    ) -> SegmentMeta:
        """Build the layout from one adapter slot per token (`BASE_ONLY` = -1 for none).

        `adapter_ids` is (num_tokens,) in batch order; slots must lie in
        `[-1, num_adapters)`. The result lives on `device` (default: the ids' device).
        """
        ids = torch.as_tensor(adapter_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"adapter_ids must be 1-D (one id per token), got shape {tuple(ids.shape)}")
        if num_adapters < 1:
            raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
        device = torch.device(device) if device is not None else ids.device
        ids_cpu = ids.cpu()
        if ids_cpu.numel() and (ids_cpu.min() < BASE_ONLY or ids_cpu.max() >= num_adapters):
            bad = ids_cpu[(ids_cpu < BASE_ONLY) | (ids_cpu >= num_adapters)]
            raise ValueError(
                f"adapter ids must lie in [-1, {num_adapters}) for {num_adapters} slots; got {bad.unique().tolist()}"
            )
        # Base-only tokens sort after every adapter's segment.
        key = torch.where(ids_cpu == BASE_ONLY, torch.full_like(ids_cpu, num_adapters), ids_cpu)
        _, order = torch.sort(key, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        counts = torch.bincount(key, minlength=num_adapters + 1)[:num_adapters]
        starts = [0] + torch.cumsum(counts, 0).tolist()
        return cls(
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            token_order=order.to(device),
            inverse_order=inverse.to(device),
            starts=tuple(int(s) for s in starts),
            num_tokens=int(ids_cpu.numel()),
            max_seg_len=int(counts.max()) if counts.numel() else 0,
            is_sorted=bool(torch.equal(order, torch.arange(order.numel()))),
        )

    @classmethod
    def from_seq_lens(
        cls,
        seq_adapter_ids: Sequence[int],
        seq_lens: Sequence[int],
        num_adapters: int,
        device: torch.device | str | None = None,
    ) -> SegmentMeta:
        """Build the layout for packed sequences: sequence k has `seq_lens[k]` tokens, all
        served by adapter slot `seq_adapter_ids[k]` (-1 for base-only).

        Example: `seq_adapter_ids=[1, 0, 1]`, `seq_lens=[3, 2, 4]` -> per-token ids
        `[1, 1, 1, 0, 0, 1, 1, 1, 1]`, `seg_starts` `[0, 2, 9]` for two slots.
        Sequences already grouped by ascending slot give `is_sorted=True` (no gathers).
        """
        if len(seq_adapter_ids) != len(seq_lens):
            raise ValueError(
                f"{len(seq_adapter_ids)} sequence adapter ids but {len(seq_lens)} sequence lengths"
            )
        if any(n < 0 for n in seq_lens):
            raise ValueError(f"sequence lengths must be >= 0, got {list(seq_lens)}")
        ids = torch.repeat_interleave(
            torch.as_tensor(list(seq_adapter_ids), dtype=torch.int64),
            torch.as_tensor(list(seq_lens), dtype=torch.int64),
        )
        return cls.from_token_adapter_ids(ids, num_adapters, device=device)

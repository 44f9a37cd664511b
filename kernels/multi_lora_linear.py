"""A linear layer with a frozen base weight and one LoRA adapter per slot, mixed in one batch.

Semantics, for a batch whose token t is served by adapter slot a(t) (-1: base only):
    y[t] = x[t] @ W^T + bias + (x[t] @ A[a(t)] @ B[a(t)] * scale[a(t)] if a(t) >= 0 else 0)

    x: (..., hidden_in) with prod(...) == meta.num_tokens, tokens in batch order
    W: (hidden_out, hidden_in) frozen (never receives a gradient)
    A: (num_adapters, hidden_in, max_rank), B: (num_adapters, max_rank, hidden_out),
       zero-padded past each adapter's own rank; scale: (num_adapters,) fp32

Use `multi_lora_linear` with tensors you own (e.g. the learner's stacked adapter state), or
`MultiLoRALinear`, which wraps an `nn.Linear` and owns the stacked adapter parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .autograd import segmented_lora
from .backends import BackendName, SegmentedBackend, make_backend
from .segments import SegmentMeta


def multi_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    backend: SegmentedBackend,
) -> torch.Tensor:
    """Base projection plus the segmented LoRA delta (see the module's Semantics)."""
    if weight.requires_grad:
        raise ValueError("the base weight must be frozen (requires_grad=False) in a multi-LoRA linear")
    lead, hidden_in = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, hidden_in)  # (tokens, hidden_in), batch order
    delta_sorted = segmented_lora(meta.to_sorted(tokens), lora_a, lora_b, scale, meta, backend)
    delta = meta.to_batch_order(delta_sorted)  # (tokens, hidden_out)
    return F.linear(x, weight, bias) + delta.reshape(*lead, -1)


class MultiLoRALinear(nn.Module):
    """`nn.Linear` with a frozen base and `num_adapters` LoRA slots of rank <= `max_rank`.

    Slots start empty (A = B = 0, scale 0). `set_adapter(slot, A, B, scale)` loads an
    adapter of any rank <= max_rank; `forward(x, meta)` applies each token's adapter.
    The backend (`auto`: Triton on CUDA, torch on CPU) is built here, for the device of
    the base weight; pass a backend object to choose explicitly.
    """

    def __init__(
        self,
        base: nn.Linear,
        num_adapters: int,
        max_rank: int,
        *,
        backend: BackendName | SegmentedBackend = "auto",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_adapters < 1 or max_rank < 1:
            raise ValueError(f"need num_adapters >= 1 and max_rank >= 1, got {num_adapters} and {max_rank}")
        self.base = base
        self.base.requires_grad_(False)
        device, dtype = base.weight.device, dtype or base.weight.dtype
        self.max_rank = max_rank
        # Stacked, zero-padded adapter weights: slot i uses A[i][:, :rank_i] and B[i][:rank_i].
        self.lora_a = nn.Parameter(torch.zeros(num_adapters, base.in_features, max_rank, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(num_adapters, max_rank, base.out_features, device=device, dtype=dtype))
        self.register_buffer("scale", torch.zeros(num_adapters, device=device, dtype=torch.float32))
        self.register_buffer("ranks", torch.zeros(num_adapters, device=device, dtype=torch.int64))
        self.backend = make_backend(backend, device=device) if isinstance(backend, str) else backend

    @property
    def num_adapters(self) -> int:
        return self.lora_a.shape[0]

    @torch.no_grad()
    def set_adapter(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Load one adapter into `slot`: A (hidden_in, rank), B (rank, hidden_out), scale = alpha / rank.

        (PEFT stores the transposes: `lora_A.weight` is (rank, hidden_in).)
        """
        self._check_slot(slot)
        rank = lora_a.shape[1]
        if lora_a.shape != (self.base.in_features, rank) or lora_b.shape != (rank, self.base.out_features):
            raise ValueError(
                f"adapter for slot {slot}: expected A ({self.base.in_features}, r) and B (r, "
                f"{self.base.out_features}), got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
            )
        if rank > self.max_rank:
            raise ValueError(f"adapter for slot {slot} has rank {rank}, above this layer's max_rank {self.max_rank}")
        self.clear_adapter(slot)
        self.lora_a[slot, :, :rank] = lora_a
        self.lora_b[slot, :rank, :] = lora_b
        self.scale[slot] = scale
        self.ranks[slot] = rank

    @torch.no_grad()
    def clear_adapter(self, slot: int) -> None:
        """Empty `slot`: its tokens then get the base output only."""
        self._check_slot(slot)
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scale[slot] = 0.0
        self.ranks[slot] = 0

    def adapter(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slot's A (hidden_in, rank) and B (rank, hidden_out), unpadded."""
        self._check_slot(slot)
        rank = int(self.ranks[slot])
        return self.lora_a[slot, :, :rank], self.lora_b[slot, :rank, :]

    def forward(self, x: torch.Tensor, meta: SegmentMeta) -> torch.Tensor:
        if meta.num_adapters != self.num_adapters:
            raise ValueError(f"SegmentMeta has {meta.num_adapters} slots but this layer has {self.num_adapters}")
        return multi_lora_linear(
            x, self.base.weight, self.base.bias, self.lora_a, self.lora_b, self.scale, meta, self.backend
        )

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_adapters:
            raise IndexError(f"adapter slot {slot} out of range for {self.num_adapters} slots")

    def extra_repr(self) -> str:
        return (
            f"in={self.base.in_features}, out={self.base.out_features}, adapters={self.num_adapters}, "
            f"max_rank={self.max_rank}, backend={self.backend!r}"
        )

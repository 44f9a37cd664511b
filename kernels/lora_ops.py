"""Segmented LoRA shrink, expand and their backward, over tokens sorted by adapter slot.

Each op is written once on top of a `SegmentedBackend`, so `TorchBackend()` gives the
pure-torch reference and `TritonBackend()` the kernels. Adapters of different ranks share
one stacked tensor padded with zeros to the maximum rank: zero columns of A and zero rows
of B contribute nothing and receive zero gradient, so padding is exact.

Shapes (A and B are the transposes of PEFT's `lora_A.weight` / `lora_B.weight`):
    x:     (tokens, hidden_in)               sorted by adapter (`SegmentMeta.to_sorted`)
    A:     (num_adapters, hidden_in, rank)   rank = max rank over adapters
    B:     (num_adapters, rank, hidden_out)
    scale: (num_adapters,) fp32, alpha / rank per adapter
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import SegmentedBackend
from .segments import SegmentMeta


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: SegmentMeta, backend: SegmentedBackend) -> torch.Tensor:
    """Project tokens down to each adapter's rank.

    Semantics: `v[s[i]:s[i+1]] = x[s[i]:s[i+1]] @ A[i]`; base-only rows of v are 0.
    Returns v: (tokens, rank) in x's dtype.
    """
    return backend.segmented_mm(x, lora_a, meta)


def lora_expand(
    y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor, meta: SegmentMeta, backend: SegmentedBackend
) -> torch.Tensor:
    """Project back up and add into y in place.

    Semantics: `y[s[i]:s[i+1]] += v[s[i]:s[i+1]] @ B[i] * scale[i]`; base-only rows untouched.
    y: (tokens, hidden_out), v: (tokens, rank). Returns y.
    """
    return backend.segmented_mm(v, lora_b, meta, scale, out=y)


@dataclass(frozen=True)
class LoRAGrads:
    """Gradients of the segmented LoRA delta `x @ A[i] @ B[i] * scale[i]`."""

    x: torch.Tensor  # (tokens, hidden_in); base-only rows are 0
    lora_a: torch.Tensor  # (num_adapters, hidden_in, rank); 0 for adapters with empty segments
    lora_b: torch.Tensor  # (num_adapters, rank, hidden_out)


def lora_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    backend: SegmentedBackend,
) -> LoRAGrads:
    """Backward of `delta = expand(shrink(x))`, segment by segment.

    Semantics, for each adapter slot i over its rows r = s[i]:s[i+1]:
        dv[r]   = dy[r] @ B[i]^T * scale[i]          # (seg_len, rank)
        dx[r]   = dv[r] @ A[i]^T                     # (seg_len, hidden_in)
        dA[i]   = x[r]^T @ dv[r]                     # (hidden_in, rank)
        dB[i]   = v[r]^T @ dy[r] * scale[i]          # (rank, hidden_out)
    `v` is the shrink output saved by the forward pass.
    """
    grad_v = backend.segmented_mm(grad_y, lora_b.transpose(1, 2), meta, scale)  # (tokens, rank)
    grad_x = backend.segmented_mm(grad_v, lora_a.transpose(1, 2), meta)  # (tokens, hidden_in)
    grad_a = backend.segmented_weight_grad(x, grad_v, meta, out_dtype=lora_a.dtype)
    grad_b = backend.segmented_weight_grad(v, grad_y, meta, scale, out_dtype=lora_b.dtype)
    return LoRAGrads(x=grad_x, lora_a=grad_a, lora_b=grad_b)

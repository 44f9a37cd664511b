"""The autograd function for the segmented LoRA delta, so several tenants train in one pass.

Semantics (tokens already sorted by adapter slot, see `SegmentMeta`):
    delta[s[i]:s[i+1]] = x[s[i]:s[i+1]] @ A[i] @ B[i] * scale[i]    # (tokens, hidden_out)
    base-only rows of delta are 0; gradients flow to x, A and B (not to scale).
"""

from __future__ import annotations

import torch

from .backends import SegmentedBackend
from .lora_ops import lora_backward, lora_shrink
from .segments import SegmentMeta


class SegmentedLoRAFunction(torch.autograd.Function):
    """`delta = segmented_lora(x, A, B, scale)` with the backend's kernels in both passes."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, scale, meta: SegmentMeta, backend: SegmentedBackend):
        # x: (tokens, hidden_in), lora_a: (n, hidden_in, rank), lora_b: (n, rank, hidden_out)
        v = lora_shrink(x, lora_a, meta, backend)  # (tokens, rank)
        delta = backend.segmented_mm(v, lora_b, meta, scale)  # (tokens, hidden_out): expand into fresh memory
        ctx.save_for_backward(x, v, lora_a, lora_b, scale)
        ctx.meta = meta
        ctx.backend = backend
        return delta

    @staticmethod
    def backward(ctx, grad_delta):
        x, v, lora_a, lora_b, scale = ctx.saved_tensors
        grads = lora_backward(grad_delta.contiguous(), x, v, lora_a, lora_b, scale, ctx.meta, ctx.backend)
        return (
            grads.x if ctx.needs_input_grad[0] else None,
            grads.lora_a if ctx.needs_input_grad[1] else None,
            grads.lora_b if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
        )


def segmented_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    backend: SegmentedBackend,
) -> torch.Tensor:
    """Differentiable segmented LoRA delta over sorted tokens (see the module's Semantics)."""
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise TypeError(f"x, A and B must share a dtype; got {x.dtype}, {lora_a.dtype}, {lora_b.dtype}")
    if lora_a.shape[2] != lora_b.shape[1]:
        raise ValueError(f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} disagree on rank")
    return SegmentedLoRAFunction.apply(x, lora_a, lora_b, scale, meta, backend)

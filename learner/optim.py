"""AdamW over one tenant's flat state buffer: a few vector ops, whatever the layer count.

Operates on a device slot's rows (master, exp_avg, exp_avg_sq, grad: (P,) each, see
adapter_store.py). The step count lives in the tenant's `AdapterState`, so every tenant has
its own bias correction and nothing is shared between tenants.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

from clora.learner.adapter_store import DeviceSlot


class AdamConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled (AdamW) decay of the LoRA weights."""
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global grad norm of the adapter to this (None: no clipping)."""


@torch.no_grad()
def adam_step(slot: DeviceSlot, step: int, lr: float, cfg: AdamConfig) -> float:
    """One AdamW update of the slot's master/exp_avg/exp_avg_sq (P,) in place from its grad row,
    `step` counting from 1. Zeroes the grad row; returns the grad norm before clipping."""
    if step < 1:
        raise ValueError(f"adam step counts from 1, got {step}")
    w, m, v, g = slot.master, slot.exp_avg, slot.exp_avg_sq, slot.grad  # (P,) each
    norm = float(torch.linalg.vector_norm(g))
    if not math.isfinite(norm):
        g.zero_()
        raise FloatingPointError(f"non-finite gradient norm {norm} at step {step}; update skipped")
    if cfg.max_grad_norm is not None and norm > cfg.max_grad_norm:
        g.mul_(cfg.max_grad_norm / (norm + 1e-6))
    m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    bc1, bc2 = 1 - cfg.beta1 ** step, 1 - cfg.beta2 ** step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(cfg.eps)
    if cfg.weight_decay:
        w.mul_(1 - lr * cfg.weight_decay)
    w.addcdiv_(m, denom, value=-lr / bc1)
    g.zero_()
    return norm

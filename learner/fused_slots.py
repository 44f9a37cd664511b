"""Device memory for K tenants resident at once, laid out for the segmented multi-LoRA kernels.

Owns `FusedSlots`. Where `DeviceSlot` (adapter_store.py) holds one tenant, this holds up to
`capacity` = K tenants in stacked tensors

    master:  (K, P) fp32         row i = the master weights of the tenant in slot i
    moments: (K, 2, P) fp32      exp_avg | exp_avg_sq of slot i
    grad:    (K, P) fp32         grad accumulation of slot i

so loading or writing back one tenant is three copies of its (4, P) host buffer, and its
optimizer rows are contiguous (P,) vectors that `adam_step` updates unchanged (`row(i)`).

Every adapted site sees ALL K tenants as one strided view of the same memory, in the shapes
the LoRA wrappers need (PEFT orientation, the kernels take their transposes):

    A_site = master[:, a_offset : a_offset + r*in].view(K, r, in)    strides (P, in, 1)
    B_site = master[:, b_offset : b_offset + out*r].view(K, out, r)

Those views are leaf parameters whose `.grad` are the matching views of the grad row, so a
backward through the fused batch accumulates each tenant's gradient in place into its own
grad row: no gather before the forward, no scatter after the backward. As in `DeviceSlot`,
the weights are an allocation apart from the grads (autograd's version counter is per
storage), and with a compute dtype below fp32 a cast copy of the weights sits next to them.

Residency (registered vs active): `assign` makes a set of tenants resident, keeping those
already in a slot, and evicting the least recently used others (written back to their host
buffers). The adapter store stays the owner of every tenant's host state; see `claim`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from clora.learner.adapter_store import EXP_AVG, EXP_AVG_SQ, GRAD, MASTER, AdapterStore
from clora.learner.lora import LoraLayout


class FusedCapacityError(RuntimeError):
    """More tenants asked for one fused step than there are fused slots."""


@dataclass(frozen=True)
class RowSlot:
    """One tenant's optimizer rows inside `FusedSlots` (what `adam_step` needs), each (P,)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor


class FusedSlots:
    """K device slots in stacked memory, with per-site (K, ...) LoRA parameter views."""

    def __init__(self, layout: LoraLayout, capacity: int, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32):
        if capacity < 1:
            raise ValueError(f"fused slots need capacity >= 1, got {capacity}")
        k, p, r = capacity, layout.numel, layout.spec.rank
        self.layout, self.capacity, self.device = layout, capacity, torch.device(device)
        self.master = torch.zeros(k, p, dtype=torch.float32, device=device)  # (K, P)
        self.moments = torch.zeros(k, 2, p, dtype=torch.float32, device=device)  # (K, 2, P)
        self.grad = torch.zeros(k, p, dtype=torch.float32, device=device)  # (K, P), same strides as master
        self.separate = compute_dtype != torch.float32
        if self.separate:
            self.weights = torch.zeros(k, p, dtype=compute_dtype, device=device)  # (K, P)
            self.grads = torch.zeros(k, p, dtype=compute_dtype, device=device)  # (K, P)
        else:
            self.weights, self.grads = self.master, self.grad
        self.params: list[tuple[nn.Parameter, nn.Parameter]] = []
        for s in layout.sites:
            a_cols = slice(s.a_offset, s.a_offset + r * s.in_features)
            b_cols = slice(s.b_offset, s.b_offset + s.out_features * r)
            pa = nn.Parameter(self.weights[:, a_cols].view(k, r, s.in_features))  # (K, r, in)
            pb = nn.Parameter(self.weights[:, b_cols].view(k, s.out_features, r))  # (K, out, r)
            pa.grad = self.grads[:, a_cols].view(k, r, s.in_features)
            pb.grad = self.grads[:, b_cols].view(k, s.out_features, r)
            self.params.append((pa, pb))
        self.tenants: list[str | None] = [None] * k
        self._last_used = [0] * k
        self._clock = 0

    @property
    def nbytes(self) -> int:
        extra = 2 * self.weights.numel() * self.weights.element_size() if self.separate else 0
        return (self.master.numel() + self.moments.numel() + self.grad.numel()) * 4 + extra

    def slot_of(self, tenant: str) -> int | None:
        return self.tenants.index(tenant) if tenant in self.tenants else None

    def row(self, i: int) -> RowSlot:
        """Slot i's optimizer rows (views), for `adam_step`."""
        return RowSlot(self.master[i], self.moments[i, 0], self.moments[i, 1], self.grad[i])

    # --- copies -----------------------------------------------------------------------------

    def load(self, i: int, host: torch.Tensor) -> None:
        """host (4, P) -> slot i: three copies."""
        self.master[i].copy_(host[MASTER], non_blocking=True)
        self.moments[i].copy_(host[EXP_AVG:EXP_AVG_SQ + 1], non_blocking=True)
        self.grad[i].copy_(host[GRAD], non_blocking=True)
        self.sync_weights(i)

    def write_back(self, i: int, host: torch.Tensor) -> None:
        """slot i -> host (4, P): three copies."""
        host[MASTER].copy_(self.master[i], non_blocking=True)
        host[EXP_AVG:EXP_AVG_SQ + 1].copy_(self.moments[i], non_blocking=True)
        host[GRAD].copy_(self.grad[i], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def sync_weights(self, i: int) -> None:
        """After slot i's master row changed: refresh its compute-dtype copy (no-op in fp32)."""
        if self.separate:
            self.weights[i].copy_(self.master[i])

    def fold_grads(self) -> None:
        """After a backward: move compute-dtype grads into the fp32 grad rows (no-op in fp32)."""
        if self.separate:
            self.grad.add_(self.grads.float())
            self.grads.zero_()

    # --- residency --------------------------------------------------------------------------

    def claim(self, store: AdapterStore, tenant: str) -> torch.Tensor:
        """Take `tenant` over from the adapter store: its host buffer made current (a copy the
        store holds on the device is written back) and the store's device copy dropped, so the
        store can never later write a stale copy over what this slot trains. Returns (4, P)."""
        state = store.state(tenant)
        store.put(state)  # forgets any device copy of this tenant; keeps the same state object
        return state.buffer

    def assign(self, tenants: list[str], store: AdapterStore) -> tuple[list[int], float]:
        """Make `tenants` resident; returns their slots (in the order given) and the seconds
        spent writing back evicted tenants and loading new ones."""
        if len(set(tenants)) != len(tenants):
            raise ValueError(f"a fused step takes each tenant once, got {tenants}")
        if len(tenants) > self.capacity:
            raise FusedCapacityError(
                f"{len(tenants)} tenants asked for one fused step but only {self.capacity} fused slots exist "
                f"({sum(t is not None for t in self.tenants)} resident: {[t for t in self.tenants if t]})")
        t0 = time.perf_counter()
        self._clock += 1
        slots: list[int | None] = [self.slot_of(t) for t in tenants]
        wanted = set(tenants)
        free = sorted((i for i, t in enumerate(self.tenants) if t not in wanted),
                      key=lambda i: (self.tenants[i] is not None, self._last_used[i]))
        for n, tenant in enumerate(tenants):
            if slots[n] is None:
                i = free.pop(0)
                self.evict(i, store)
                self.load(i, self.claim(store, tenant))
                self.tenants[i] = tenant
                slots[n] = i
            self._last_used[slots[n]] = self._clock
        return [int(i) for i in slots], time.perf_counter() - t0

    def evict(self, i: int, store: AdapterStore) -> None:
        """Write slot i's tenant back to its host buffer and empty the slot."""
        tenant = self.tenants[i]
        if tenant is None:
            return
        self.flush(tenant, store)
        self.tenants[i] = None

    def flush(self, tenant: str, store: AdapterStore) -> None:
        """Write a resident tenant back to its host buffer (it stays resident). Call this before
        anything reads the tenant through the store (evaluation, checkpoint, publish)."""
        i = self.slot_of(tenant)
        if i is None:
            raise KeyError(f"tenant {tenant!r} is not resident in the fused slots ({self.tenants})")
        self.write_back(i, self.claim(store, tenant))

"""The adapter store: every tenant's training state on the host, exactly one on the device.

Owns `AdapterState` (one object per tenant) and `AdapterStore` (registration, capacity,
swapping, prefetch). A tenant's numeric state is ONE contiguous fp32 host buffer

    buffer: (4, P)   rows: master weights | Adam exp_avg | Adam exp_avg_sq | grad accumulation

(P = LoraLayout.numel), pinned when CUDA is present. Swapping a tenant in or out is one
`copy_` of that buffer, whatever the number of layers: no per-tensor Python work.

On the device there are two `DeviceSlot`s, `active` and `staging`. The active slot is what
the LoRA wrappers read (its parameters are views into the slot buffer, their `.grad` views
into the grad row). `prefetch(next)` fills the staging slot in the background while the
active one trains; `activate(next)` then only flips the slots and queues the write-back of
the previous tenant. On the device the master row is its own allocation, apart from the
other three rows (see DeviceSlot). The LoRA weights the model computes with are the master row itself in
fp32; with a lower compute dtype (bf16 on GPU) the slot keeps a cast copy next to it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from clora.freshness import VersionLineage
from clora.learner.copy_engine import CopyHandle, make_copy_engine
from clora.learner.lora import LoraLayout, LoraModel

MASTER, EXP_AVG, EXP_AVG_SQ, GRAD = range(4)
ROWS = 4


class AdapterCapacityError(RuntimeError):
    """Registering another tenant would exceed the store's cap."""


class UnknownTenantError(KeyError):
    pass


@dataclass
class AdapterState:
    """One tenant's complete training state (host side). Checkpoints save exactly this."""

    tenant: str
    seed: int
    buffer: torch.Tensor
    """(4, P) fp32: master weights, exp_avg, exp_avg_sq, grad accumulation."""
    rng_state: torch.Tensor
    """torch.Generator state (uint8): data sampling seeds and LoRA dropout draw from it."""
    step: int = 0
    """Optimizer steps taken (each tenant has its own Adam bias correction)."""
    micro_steps: int = 0
    """Micro-batches accumulated in the grad row since the last optimizer step."""
    examples_seen: int = 0
    cursor: int = 0
    """Replay-buffer cursor: the highest sequence number trained on as fresh data."""
    last_published_version: int | None = None
    """The version these weights descend from: the last one published from them, or the one
    they were set to when someone else chose the live version (`TenantLifecycle.follow_live`,
    the reward guard's rollback). None until either happens."""
    feedback_window: tuple[float, float] | None = None
    """(first, last) feedback time of the examples trained on since the last publish: the
    next version's `feedback_window`. None when nothing was trained on since."""
    lineage: VersionLineage | None = None
    """The feedback events first trained since the last publish (fresh examples; a replayed one
    was first trained in an earlier version), with their accept times: the next version's
    lineage (`clora.freshness`). None when no fresh example was trained on since."""
    reward_baseline: float | None = None
    """Running mean of the rewards of the tenant's ungrouped scored samples (a thumbs up/down on
    one response): their policy-gradient baseline (`losses.running_baseline`). None until the
    first such sample trained."""

    @property
    def master(self) -> torch.Tensor:  # (P,)
        return self.buffer[MASTER]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size() + self.rng_state.numel()

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.set_state(self.rng_state)
        return g

    def save_generator(self, g: torch.Generator) -> None:
        self.rng_state = g.get_state()


class DeviceSlot:
    """Device memory for one resident tenant: its state plus LoRA parameter views.

    Two allocations: `master` (P,) and `rest` (3, P) = exp_avg | exp_avg_sq | grad. The weights
    must not share storage with the grads: autograd's version counter is per storage, and the
    in-place grad accumulation would otherwise invalidate the weights saved for backward.
    """

    def __init__(self, layout: LoraLayout, device: torch.device, compute_dtype: torch.dtype):
        self.master = torch.zeros(layout.numel, dtype=torch.float32, device=device)  # (P,)
        self.rest = torch.zeros(ROWS - 1, layout.numel, dtype=torch.float32, device=device)  # (3, P)
        self.exp_avg, self.exp_avg_sq, self.grad = self.rest[0], self.rest[1], self.rest[2]
        self.separate = compute_dtype != torch.float32
        if self.separate:
            self.weights = torch.zeros(layout.numel, dtype=compute_dtype, device=device)
            self.grads = torch.zeros(layout.numel, dtype=compute_dtype, device=device)
        else:
            self.weights, self.grads = self.master, self.grad
        self.params: list[tuple[nn.Parameter, nn.Parameter]] = []
        for (a, b), (ga, gb) in zip(layout.views(self.weights), layout.views(self.grads)):
            pa, pb = nn.Parameter(a), nn.Parameter(b)
            pa.grad, pb.grad = ga, gb  # backward accumulates in place into the grad buffer
            self.params.append((pa, pb))
        self.tenant: str | None = None
        self.pending: CopyHandle | None = None
        self.reduce: Callable[[torch.Tensor], None] | None = None
        """Completes the grad row after each backward where the model splits its arithmetic over
        processes (`MegatronLoraModel.reduce_grads`); None where one process computes it all."""

    @property
    def nbytes(self) -> int:
        extra = 2 * self.weights.numel() * self.weights.element_size() if self.separate else 0
        return (self.master.numel() + self.rest.numel()) * 4 + extra

    def load_from(self, host: torch.Tensor) -> None:
        """host (4, P) -> device: two copies, whatever the number of layers."""
        self.master.copy_(host[MASTER], non_blocking=True)
        self.rest.copy_(host[MASTER + 1:], non_blocking=True)
        self.sync_weights()

    def store_to(self, host: torch.Tensor) -> None:
        host[MASTER].copy_(self.master, non_blocking=True)
        host[MASTER + 1:].copy_(self.rest, non_blocking=True)

    def sync_weights(self) -> None:
        """After the master row changed: refresh the compute-dtype copy (no-op in fp32)."""
        if self.separate:
            self.weights.copy_(self.master)

    def fold_grads(self) -> None:
        """After a backward: move compute-dtype grads into the fp32 grad row (no-op in fp32), then
        add the other processes' shares where the model is split (`reduce`)."""
        if self.separate:
            self.grad.add_(self.grads.float())
            self.grads.zero_()
        if self.reduce is not None:
            self.reduce(self.grad)


@dataclass
class SwapStats:
    swaps: int = 0
    prefetch_hits: int = 0
    exposed_s: float = 0.0
    """Wall time `activate` blocked the trainer (the swap cost not hidden by prefetch)."""


class AdapterStore:
    """Registered tenants (host) vs the one resident tenant (device), with prefetch."""

    def __init__(self, model: LoraModel, *, device: str | torch.device = "cpu",
                 compute_dtype: torch.dtype = torch.float32, prefetch: bool = True,
                 max_tenants: int | None = None, max_host_bytes: int | None = None):
        self.model = model
        self.layout = model.layout
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.max_tenants = max_tenants
        self.max_host_bytes = max_host_bytes
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._engine = make_copy_engine(self.device, prefetch)
        self._states: dict[str, AdapterState] = {}
        self._active = DeviceSlot(self.layout, self.device, compute_dtype)
        self._staging = DeviceSlot(self.layout, self.device, compute_dtype)
        self._active.reduce = self._staging.reduce = getattr(model, "reduce_grads", None)
        self._lock = threading.RLock()
        self.stats = SwapStats()

    # --- accounting -------------------------------------------------------------------------

    @property
    def bytes_per_tenant(self) -> int:
        """Host bytes one registered tenant costs (state buffer + RNG state)."""
        return ROWS * self.layout.numel * 4 + torch.Generator().get_state().numel()

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    @property
    def device_bytes(self) -> int:
        return self._active.nbytes + self._staging.nbytes

    def _check_capacity(self, tenant: str) -> None:
        n, need = len(self._states), self.bytes_per_tenant
        over_count = self.max_tenants is not None and n + 1 > self.max_tenants
        over_bytes = self.max_host_bytes is not None and self.host_bytes + need > self.max_host_bytes
        if over_count or over_bytes:
            raise AdapterCapacityError(
                f"cannot register tenant {tenant!r}: {n} tenants registered using {self.host_bytes} B of host memory "
                f"(cap {self.max_tenants} tenants / {self.max_host_bytes} B, {need} B per tenant); "
                f"{int(self._active.tenant is not None)} resident on {self.device} using {self.device_bytes} B")

    # --- registration -----------------------------------------------------------------------

    def register(self, tenant: str, seed: int, master: torch.Tensor | None = None) -> AdapterState:
        """A new tenant from a pristine state: zero moments, and master weights from `master`
        (P,) when given (an imported or published adapter), else a LoRA init from its own seed."""
        with self._lock:
            if tenant in self._states:
                return self._states[tenant]
            if master is not None and tuple(master.shape) != (self.layout.numel,):
                raise ValueError(f"master weights of {tenant!r} have shape {tuple(master.shape)}, "
                                 f"store expects ({self.layout.numel},)")
            self._check_capacity(tenant)
            g = torch.Generator().manual_seed(seed)
            buffer = torch.zeros(ROWS, self.layout.numel, dtype=torch.float32, pin_memory=self._pin)
            if master is None:
                self.layout.init_(buffer[MASTER], g)
            else:
                buffer[MASTER].copy_(master)
            state = AdapterState(tenant=tenant, seed=seed, buffer=buffer, rng_state=g.get_state())
            self._states[tenant] = state
            return state

    def put(self, state: AdapterState) -> None:
        """Register (or replace) a tenant's state, e.g. restored from a checkpoint."""
        with self._lock:
            if state.buffer.shape != (ROWS, self.layout.numel):
                raise ValueError(f"state of {state.tenant!r} has shape {tuple(state.buffer.shape)}, "
                                 f"store expects {(ROWS, self.layout.numel)}")
            if state.tenant not in self._states:
                self._check_capacity(state.tenant)
            if self._pin and not state.buffer.is_pinned():
                state.buffer = state.buffer.pin_memory()
            self._engine.drain()
            for slot in (self._active, self._staging):
                if slot.tenant == state.tenant:  # a stale device copy must not be written back later
                    slot.tenant = None
            if self.model.bank.params is not None and self._active.tenant is None:
                self.model.bind(None)
            self._states[state.tenant] = state

    def remove(self, tenant: str) -> AdapterState:
        """Drop `tenant`'s state from the store (and any device copy of it, unwritten); returns
        the host state as it was last written back. The caller saved what it must keep."""
        with self._lock:
            if tenant not in self._states:
                raise UnknownTenantError(tenant)
            if self._active.tenant == tenant:
                self._copy_out(self._active)
            self._engine.drain()
            for slot in (self._active, self._staging):
                if slot.tenant == tenant:
                    slot.tenant = None
            if self._active.tenant is None and self.model.bank.params is not None:
                self.model.bind(None)
            return self._states.pop(tenant)

    def tenants(self) -> list[str]:
        return list(self._states)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._states

    def peek(self, tenant: str) -> AdapterState:
        """The tenant's state object without syncing: its scalars are current, but its buffer
        lags behind the device while the tenant is resident (use `state` for the buffer)."""
        try:
            return self._states[tenant]
        except KeyError:
            raise UnknownTenantError(tenant) from None

    def state(self, tenant: str) -> AdapterState:
        """The tenant's host state, up to date (waits for pending copies, flushes if resident)."""
        with self._lock:
            if tenant not in self._states:
                raise UnknownTenantError(tenant)
            if self._active.tenant == tenant:
                self._copy_out(self._active).wait()
            self._engine.drain()
            return self._states[tenant]

    # --- residency ----------------------------------------------------------------------------

    @property
    def active_tenant(self) -> str | None:
        return self._active.tenant

    @property
    def active(self) -> DeviceSlot:
        return self._active

    def _copy_in(self, slot: DeviceSlot, tenant: str) -> CopyHandle:
        src = self._states[tenant].buffer
        slot.tenant = tenant

        slot.pending = self._engine.submit(lambda: slot.load_from(src))
        return slot.pending

    def _copy_out(self, slot: DeviceSlot) -> CopyHandle:
        dst = self._states[slot.tenant].buffer
        return self._engine.submit(lambda: slot.store_to(dst))

    def prefetch(self, tenant: str) -> None:
        """Start loading `tenant` into the staging slot; returns at once."""
        with self._lock:
            if tenant not in self._states:
                raise UnknownTenantError(tenant)
            if tenant in (self._active.tenant, self._staging.tenant):
                return
            self._copy_in(self._staging, tenant)

    def activate(self, tenant: str) -> DeviceSlot:
        """Make `tenant` the resident one and bind its LoRA weights into the model."""
        with self._lock:
            if tenant not in self._states:
                raise UnknownTenantError(tenant)
            if self._active.tenant == tenant:
                self.model.bind(self._active.params)
                return self._active
            t0 = time.perf_counter()
            if self._staging.tenant == tenant:
                self.stats.prefetch_hits += 1
            else:
                self._copy_in(self._staging, tenant)
            self._staging.pending.wait()
            if self._active.tenant is not None:
                self._copy_out(self._active)  # async write-back; FIFO before any reuse of this slot
            self._active, self._staging = self._staging, self._active
            self._staging.tenant = None
            self.model.bind(self._active.params)
            self.stats.swaps += 1
            self.stats.exposed_s += time.perf_counter() - t0
            return self._active

    def flush(self) -> None:
        """Write the resident tenant back and wait for every pending copy."""
        with self._lock:
            if self._active.tenant is not None:
                self._copy_out(self._active)
            self._engine.drain()

    def close(self) -> None:
        self.flush()
        self._engine.close()

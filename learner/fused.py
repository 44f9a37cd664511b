"""Fused multi-tenant training: one optimizer step for each of K tenants from one forward and
one backward through the frozen base.

Owns `TenantWork` (one tenant's share of a fused step), `FusedStepResult` and `FusedTrainer`.
A fused step:

1. makes the K tenants resident in `FusedSlots` (those already there stay; the others are
   loaded from the adapter store, evicting the least recently used; the store's swap path
   still serves every tenant beyond K);
2. for each algorithm present (SFT, DPO, RL) and each micro-batch round j, stacks every
   tenant's j-th micro-batch into one batch sorted by slot (`fuse_token_batches`), runs the
   model once with the segmented multi-LoRA binding, and backpropagates

       objective = sum over tenants n of  loss_n(chunk_nj) * len(chunk_nj) / len(examples_n)

   where loss_n is tenant n's own loss on its own rows (its own mean). Tenant n's weights
   only touch its own rows, so d objective / d theta_n is exactly the gradient of its solo
   step (`Trainer.train_step`) on the same data: the tenants share compute, not gradients;
3. runs `adam_step` on each tenant's own rows with its own step count and learning rate.

Equivalence with K solo steps holds up to fp32 rounding (tests/learner/test_fused_equivalence.py
states the tolerance): padding to the widest tenant changes matmul shapes, and the segmented
kernel sums in another order than the solo `F.linear` chain.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from clora.kernels import BackendName, SegmentedBackend, make_backend
from clora.learner.fused_batch import FusedBinding, FusedRows, fuse_token_batches
from clora.learner.fused_slots import FusedSlots
from clora.learner.losses import dpo_loss, group_advantages, policy_gradient_loss, sequence_logprob, sft_loss, token_logprobs
from clora.learner.optim import adam_step
from clora.learner.trainer import Example, StepResult, Trainer, TrainingPolicy


@dataclass(frozen=True)
class TenantWork:
    """One tenant's part of a fused step: its examples (all of its algorithm's kind) and policy."""

    tenant: str
    examples: Sequence[Example]
    policy: TrainingPolicy


@dataclass(frozen=True)
class FusedStepResult:
    """Per-tenant results (same fields as a solo step; `seconds` is the tenant's share of the
    fused step by target tokens) and where the step's wall time went."""

    results: tuple[StepResult, ...]
    seconds: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    swap_s: float
    tokens: int


@dataclass
class _Tenant:
    """Bookkeeping of one tenant during a fused step."""

    work: TenantWork
    slot: int
    generator: torch.Generator
    advantages: torch.Tensor | None
    loss: float = 0.0
    tokens: int = 0


class FusedTrainer:
    """Trains up to `max_tenants` tenants per step through the segmented multi-LoRA layers.

    Shares model, encoder, adapter store and config with a serial `Trainer` (evaluation and
    solo steps still go through it). The kernel backend is built here (`auto`: Triton on
    CUDA, the torch reference on CPU).
    """

    def __init__(self, trainer: Trainer, max_tenants: int, backend: BackendName | SegmentedBackend = "auto"):
        self.trainer = trainer
        self.model, self.encoder, self.store, self.cfg = trainer.model, trainer.encoder, trainer.store, trainer.cfg
        self.device = trainer.device
        self.slots = FusedSlots(self.model.layout, max_tenants, self.device, self.store.compute_dtype)
        self.backend = make_backend(backend, device=self.device) if isinstance(backend, str) else backend
        self.scale = torch.full((max_tenants,), self.model.spec.scaling, dtype=torch.float32, device=self.device)

    @property
    def max_tenants(self) -> int:
        return self.slots.capacity

    def flush(self, tenants: Sequence[str] | None = None) -> None:
        """Write resident tenants (default: all) back to the store's host buffers."""
        for t in tenants if tenants is not None else [t for t in self.slots.tenants if t is not None]:
            self.slots.flush(t, self.store)

    # --- the step ----------------------------------------------------------------------------

    def train_step(self, work: Sequence[TenantWork]) -> FusedStepResult:
        """One optimizer step for every tenant in `work` (at most `max_tenants`, each once)."""
        for w in work:
            if not w.examples:
                raise ValueError(f"fused train_step: tenant {w.tenant!r} got no examples")
        if not work:
            raise ValueError("fused train_step got no tenants")
        t0 = time.perf_counter()
        slots, swap_s = self.slots.assign([w.tenant for w in work], self.store)
        tenants = []
        for w, slot in zip(work, slots):
            adv = None
            if w.policy.algorithm == "rl":
                adv = group_advantages(torch.tensor([s.reward for s in w.examples]), [s.group_id for s in w.examples])
            tenants.append(_Tenant(w, slot, self.store.peek(w.tenant).generator(), adv))
        tenants.sort(key=lambda t: t.slot)
        timing = {"forward": 0.0, "backward": 0.0}
        self.model.train()
        try:
            for algorithm in dict.fromkeys(t.work.policy.algorithm for t in tenants):
                self._train_algorithm([t for t in tenants if t.work.policy.algorithm == algorithm], timing)
            o0 = time.perf_counter()
            norms = []
            for t in tenants:
                st = self.store.peek(t.work.tenant)
                st.step += 1
                norms.append(adam_step(self.slots.row(t.slot), st.step, t.work.policy.learning_rate, self.cfg.adam))
                self.slots.sync_weights(t.slot)
            optimizer_s = time.perf_counter() - o0
        finally:
            self.model.eval()
            self.model.bank.fused = None
        seconds = time.perf_counter() - t0
        total_tokens = sum(t.tokens for t in tenants)
        results = []
        for t, norm in zip(tenants, norms):
            st = self.store.peek(t.work.tenant)
            st.micro_steps = 0
            st.examples_seen += len(t.work.examples)
            st.save_generator(t.generator)
            share = seconds * t.tokens / total_tokens if total_tokens else seconds / len(tenants)
            results.append(StepResult(t.work.tenant, st.step, t.loss, norm, len(t.work.examples), t.tokens, share))
        return FusedStepResult(tuple(results), seconds, timing["forward"], timing["backward"], optimizer_s, swap_s,
                               total_tokens)

    def _train_algorithm(self, tenants: list[_Tenant], timing: dict[str, float]) -> None:
        """Micro-batch rounds: round j fuses every tenant's j-th micro-batch (as a solo step splits it)."""
        mb = self.cfg.micro_batch_size
        rounds = max(math.ceil(len(t.work.examples) / mb) for t in tenants)
        for j in range(rounds):
            active = [t for t in tenants if j * mb < len(t.work.examples)]
            f0 = time.perf_counter()
            losses = self._losses(active, j * mb, mb)
            objective = sum(loss * (n / len(t.work.examples)) for t, (loss, n, _) in zip(active, losses))
            b0 = time.perf_counter()
            with warnings.catch_warnings():
                # The per-site parameters are strided views of (K, P) memory and so are their grads,
                # on purpose (in-place accumulation into each tenant's grad row); torch warns about it.
                warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
                objective.backward()
            self.slots.fold_grads()
            timing["forward"] += b0 - f0
            timing["backward"] += time.perf_counter() - b0
            for t, (loss, n, tokens) in zip(active, losses):
                self.store.peek(t.work.tenant).micro_steps += 1
                t.loss += float(loss.detach()) * n / len(t.work.examples)
                t.tokens += tokens

    def _bind(self, rows: FusedRows, width: int, active: list[_Tenant]) -> None:
        self.model.bank.fused = FusedBinding(
            params=self.slots.params, scale=self.scale,
            meta=rows.segment_meta(width, self.slots.capacity, self.device), backend=self.backend, rows=rows,
            dropout=self.model.spec.dropout, generators=tuple(t.generator for t in active))

    def _logprobs(self, active: list[_Tenant], batches: list, *, adapters: bool = True) -> list[torch.Tensor]:
        """One fused forward over every active tenant's batch -> per tenant (B_n, T_n - 1) logprobs."""
        rows, ids, att = fuse_token_batches([t.work.tenant for t in active], [t.slot for t in active], batches,
                                            self.encoder.tok.pad_token_id)
        ids, att = ids.to(self.device), att.to(self.device)
        self._bind(rows, ids.shape[1], active)
        if adapters:
            lp = token_logprobs(self.model(ids, att), ids)  # (R, T-1)
        else:
            with torch.no_grad(), self.model.adapter_disabled():
                lp = token_logprobs(self.model(ids, att), ids)
        return [rows.tenant_view(n, lp) for n in range(len(active))]  # active is sorted by slot, as rows

    def _losses(self, active: list[_Tenant], start: int, mb: int) -> list[tuple[torch.Tensor, int, int]]:
        """(loss, examples, target tokens) per active tenant for its micro-batch [start, start + mb)."""
        algorithm = active[0].work.policy.algorithm
        chunks = [list(t.work.examples[start:start + mb]) for t in active]
        if algorithm == "sft":
            batches = [self.encoder.sft(c) for c in chunks]
            lps = self._logprobs(active, batches)
            return [(sft_loss(lp, b.loss_mask.to(self.device)), len(c), b.num_target_tokens)
                    for lp, b, c in zip(lps, batches, chunks)]
        if algorithm == "dpo":
            pairs = [self.encoder.preference(c) for c in chunks]
            chosen = [c for c, _ in pairs]
            rejected = [r for _, r in pairs]
            ref_c = self._logprobs(active, chosen, adapters=False)
            ref_r = self._logprobs(active, rejected, adapters=False)
            pol_c = self._logprobs(active, chosen)
            pol_r = self._logprobs(active, rejected)
            out = []
            for n, (t, c, r) in enumerate(zip(active, chosen, rejected)):
                cm, rm = c.loss_mask.to(self.device), r.loss_mask.to(self.device)
                loss = dpo_loss(sequence_logprob(pol_c[n], cm), sequence_logprob(pol_r[n], rm),
                                sequence_logprob(ref_c[n], cm), sequence_logprob(ref_r[n], rm), t.work.policy.dpo_beta)
                out.append((loss, len(chunks[n]), c.num_target_tokens + r.num_target_tokens))
            return out
        batches = [self.encoder.rl(c) for c in chunks]
        lps = self._logprobs(active, batches)
        out = []
        for t, lp, b, c in zip(active, lps, batches, chunks):
            behaviour = b.behaviour_logprobs.to(self.device) if b.behaviour_logprobs is not None else lp.detach()
            adv = t.advantages[start:start + mb].to(self.device)
            loss = policy_gradient_loss(lp, behaviour, adv, b.loss_mask.to(self.device), t.work.policy.rl_clip_eps)
            out.append((loss, len(c), b.num_target_tokens))
        return out

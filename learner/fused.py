"""Fused multi-tenant training: one optimizer step for each of K tenants from shared forwards
and backwards through the frozen base.

Owns `TenantWork` (one tenant's share of a fused step), `FusedStepResult` and `FusedTrainer`.
A fused step:

1. makes the K tenants resident in `FusedSlots` (those already there stay; the others are
   loaded from the adapter store, evicting the least recently used; the store's swap path
   still serves every tenant beyond K);
2. for each algorithm present (SFT, DPO, RL): encodes every tenant's examples in the serial
   step's micro-batches (`batches.micro_batches`, exactly as `Trainer.train_step` splits them;
   RL: an episode's turns packed into one row),
   then cuts all tenants' sequences into length buckets (`plan_chunks`): chunks of similar
   width, at most `max_chunk_tokens` padded tokens each, bucketing adding at most
   `max_padding` of padding. Each chunk is one forward (rows grouped by ascending slot, the
   segmented multi-LoRA binding) and one backward, accumulating into the tenants' grad rows.
   The objective gives every sequence the weight it has in the serial step,

       SFT  row i of micro-batch m:   -sum_t logp_it * mask_it * (|m| / |E_n|) / N_m
       RL   row i:                    per_row_i / |E_n|      (its samples' token-mean surrogates, summed)
       DPO  pair i:                   -log sigmoid(beta * margin_i) / |E_n|

   (N_m = target tokens of micro-batch m, |E_n| = tenant n's examples), so the sum over
   chunks is exactly the serial objective sum_m loss_m * |m| / |E_n| whatever the chunking.
   Tenant n's weights only touch its own rows, so d objective / d theta_n is its solo step's
   gradient: the tenants share compute, not gradients;
3. runs `adam_step` on each tenant's own rows with its own step count and learning rate.

The forwards run the LM head only on the hidden states of positions some loss reads (target
tokens), not on prompt and padding positions: the head is ~20% of a small model's compute per
token (`plain_lm_head` in trainer.py; models that post-process logits take the full forward).

With LoRA dropout the unit of bucketing is a whole serial micro-batch instead of a sequence
(DPO: chosen and rejected in two forwards), at most one per tenant per chunk and in the serial
order, so each tenant draws its dropout masks from its own generator in the serial order and
shapes. Without dropout, sequences (DPO: chosen + rejected pairs) bucket freely across
tenants and micro-batches.

Equivalence with K solo steps holds up to fp32 rounding (tests/learner/test_fused_equivalence.py
states the tolerance): other padding changes matmul shapes, the segmented kernel sums in
another order than the solo `F.linear` chain, and the loss sums in another order.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from clora.kernels import BackendName, SegmentedBackend, make_backend
from clora.learner.batches import TokenBatch, micro_batches
from clora.learner.fused_batch import FusedBinding, FusedRows, pack_blocks, plan_chunks, stack_blocks
from clora.learner.fused_slots import FusedSlots
from clora.learner.losses import behaviour_or_current, clipped_surrogate, dpo_pair_losses, sample_advantages
from clora.learner.optim import adam_step
from clora.learner.trainer import MIXED, Example, StepResult, Trainer, TrainingPolicy, plain_lm_head, target_logprobs

DEFAULT_MAX_CHUNK_TOKENS = {"cpu": 1024, "cuda": 16384}
"""Padded tokens per fused forward, by device type. On CPU the cost per token is flat from a
few hundred tokens up and then grows: a long forward's (tokens, vocab) fp32 logits and their
gradients leave the cache and are page-faulted in fresh every step, so several ~1k-token
chunks beat one long forward. On a GPU bigger is better, up to memory."""
DEFAULT_MAX_PADDING = {"cpu": 0.1, "cuda": 1.0}
"""Bucketing's padding bound by device. On CPU a padded token costs what a real one does, so
buckets stay tight. On a GPU a small model's step is bound by kernel launches, not tokens:
each extra chunk is a whole forward and backward of launches, and padding is nearly free:
tight buckets would cost more chunks than the padding they save."""


@dataclass(frozen=True)
class TenantWork:
    """One tenant's part of a fused step: its examples (all of its algorithm's kind) and policy."""

    tenant: str
    examples: Sequence[Example]
    policy: TrainingPolicy


@dataclass(frozen=True)
class FusedStepResult:
    """Per-tenant results (same fields as a solo step; `seconds` is the tenant's share of the
    fused step by target tokens) and where the step's wall time went: `prepare_s` encoding,
    bucketing and packing, `forward_s` forwards and losses, `backward_s`, `optimizer_s`,
    `swap_s` loading / evicting slots. `tokens` are target tokens, `padded_tokens` the tokens
    the forwards ran over (real + padding, DPO reference passes not counted), in `chunks` chunks."""

    results: tuple[StepResult, ...]
    seconds: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    swap_s: float
    tokens: int
    prepare_s: float = 0.0
    chunks: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0


@dataclass
class _Tenant:
    """Bookkeeping of one tenant during a fused step."""

    work: TenantWork
    slot: int
    generator: torch.Generator
    advantages: torch.Tensor | None
    index: int = 0  # position in the step's tenants (ascending slot)
    tokens: int = 0
    rows: int = 0


@dataclass(frozen=True)
class _Unit:
    """Sequences that always share a chunk: one sequence (SFT, RL) or one chosen + rejected pair
    (DPO) when sequences bucket freely, a whole serial micro-batch with LoRA dropout.

    `blocks` has one padded block per forward of its chunk (DPO with dropout: chosen, then
    rejected). `weight` multiplies each of its sequences' (SFT, RL) or pairs' (DPO) loss (see
    the module doc). `pairs` (DPO): (block, row) of the chosen and of the rejected sequence."""

    tenant: _Tenant
    blocks: tuple[TokenBatch, ...]
    round: int
    weight: float
    order: int
    pairs: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def rows(self) -> int:
        return max(b.input_ids.shape[0] for b in self.blocks)

    @property
    def width(self) -> int:
        return max(b.input_ids.shape[1] for b in self.blocks)


@dataclass
class _Timing:
    """What one fused step accumulates over its chunks (seconds, counts, loss parts)."""

    prepare: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    chunks: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    losses: list = field(default_factory=list)  # detached per-tenant loss parts, summed at the end


class FusedTrainer:
    """Trains up to `max_tenants` tenants per step through the segmented multi-LoRA layers.

    Shares model, encoder, adapter store and config with a serial `Trainer` (evaluation and
    solo steps still go through it). The kernel backend is built here (`auto`: Triton on
    CUDA, the torch reference on CPU). `max_chunk_tokens` bounds the padded tokens of one
    forward (default by device, `DEFAULT_MAX_CHUNK_TOKENS`; a sequence longer than that runs
    alone); `max_padding` bounds the padding length bucketing may add (0.1 = 10%; default by
    device, `DEFAULT_MAX_PADDING`).
    """

    def __init__(self, trainer: Trainer, max_tenants: int, backend: BackendName | SegmentedBackend = "auto",
                 max_chunk_tokens: int | None = None, max_padding: float | None = None):
        self.trainer = trainer
        self.model, self.encoder, self.store, self.cfg = trainer.model, trainer.encoder, trainer.store, trainer.cfg
        self.device = trainer.device
        self.slots = FusedSlots(self.model.layout, max_tenants, self.device, self.store.compute_dtype)
        self.backend = make_backend(backend, device=self.device) if isinstance(backend, str) else backend
        self.scale = torch.full((max_tenants,), self.model.spec.scaling, dtype=torch.float32, device=self.device)
        kind = torch.device(self.device).type
        if max_chunk_tokens is None:
            max_chunk_tokens = DEFAULT_MAX_CHUNK_TOKENS.get(kind, DEFAULT_MAX_CHUNK_TOKENS["cpu"])
        if max_padding is None:
            max_padding = DEFAULT_MAX_PADDING.get(kind, DEFAULT_MAX_PADDING["cpu"])
        if max_chunk_tokens < 1 or max_padding < 0:
            raise ValueError(f"fused trainer needs max_chunk_tokens >= 1 and max_padding >= 0, "
                             f"got {max_chunk_tokens}, {max_padding}")
        self.max_chunk_tokens, self.max_padding = max_chunk_tokens, max_padding
        self._head = plain_lm_head(self.model.model)

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
        for w in work:
            if w.policy.algorithm in MIXED:
                raise ValueError(f"fused train_step: tenant {w.tenant!r} trains with {w.policy.algorithm!r}, a mixed "
                                 "step the fused trainer does not run yet (use training_mode 'serial')")
        t0 = time.perf_counter()
        slots, swap_s = self.slots.assign([w.tenant for w in work], self.store)
        tenants = []
        for w, slot in zip(work, slots):
            adv = None
            if w.policy.algorithm == "rl":
                adv = sample_advantages(w.examples)
            tenants.append(_Tenant(w, slot, self.store.peek(w.tenant).generator(), adv))
        tenants.sort(key=lambda t: t.slot)
        for i, t in enumerate(tenants):
            t.index = i
        timing = _Timing()
        self.model.train()
        try:
            for algorithm in dict.fromkeys(t.work.policy.algorithm for t in tenants):
                self._train_algorithm(algorithm, [t for t in tenants if t.work.policy.algorithm == algorithm], timing,
                                      len(tenants))
            losses = torch.stack(timing.losses).sum(0).tolist()  # one device sync for every loss
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
            results.append(StepResult(t.work.tenant, st.step, losses[t.index], norm, len(t.work.examples), t.tokens,
                                      share, t.rows))
        return FusedStepResult(tuple(results), seconds, timing.forward, timing.backward, optimizer_s, swap_s,
                               total_tokens, timing.prepare, timing.chunks, timing.real_tokens, timing.padded_tokens)

    def _train_algorithm(self, algorithm: str, tenants: list[_Tenant], timing: _Timing, num_tenants: int) -> None:
        """Encode in serial micro-batches, bucket, then one forward + backward per chunk."""
        p0 = time.perf_counter()
        free = self.model.spec.dropout == 0
        units = [u for t in tenants for u in self._units(algorithm, t, free)]
        plan = plan_chunks([u.rows * len(u.blocks) for u in units], [u.width for u in units], self.max_chunk_tokens,
                           self.max_padding, None if free else [u.round for u in units])
        timing.prepare += time.perf_counter() - p0
        for chunk in plan:
            self._train_chunk(algorithm, sorted((units[i] for i in chunk), key=lambda u: (u.tenant.slot, u.order)),
                              num_tenants, timing)

    def _units(self, algorithm: str, t: _Tenant, free: bool) -> list[_Unit]:
        """Tenant t's examples encoded in its serial micro-batches (as `Trainer.train_step`
        encodes them), cut into bucketing units: sequences (or pairs) when `free`, else whole
        micro-batches. Adds the target tokens to `t.tokens`."""
        examples, units = list(t.work.examples), []
        pad = self.encoder.tok.pad_token_id
        split = micro_batches(self.encoder, examples, self.cfg.micro_batch_size)
        self.store.peek(t.work.tenant).micro_steps += len(split)  # as a solo step counts them
        for m, idx in enumerate(split):
            chunk = [examples[i] for i in idx]
            share = len(chunk) / len(examples)  # the serial step's factor for this micro-batch's loss
            if algorithm == "dpo":
                chosen, rejected = self.encoder.preference(chunk)
                t.tokens += chosen.num_target_tokens + rejected.num_target_tokens
                t.rows += 2 * len(chunk)
                weight = share / len(chunk)  # dpo_loss: mean over pairs
                if not free:  # chosen, then rejected: two forwards, as the solo step draws dropout
                    units.append(_Unit(t, (chosen, rejected), m, weight, len(units),
                                       pairs=tuple((0, i, 1, i) for i in range(len(chunk)))))
                    continue
                for i in range(len(chunk)):
                    pair = stack_blocks([_row(chosen, i), _row(rejected, i)], pad)
                    units.append(_Unit(t, (pair,), m, weight, len(units), pairs=((0, 0, 0, 1),)))
                continue
            batch = (self.encoder.sft(chunk) if algorithm == "sft"
                     else self.encoder.rl(chunk, t.advantages[idx]))  # RL: turns packed
            n_tokens = batch.num_target_tokens
            t.tokens += n_tokens
            t.rows += batch.input_ids.shape[0]
            if algorithm == "sft":
                if n_tokens == 0:
                    raise ValueError(f"sft: tenant {t.work.tenant!r}'s micro-batch {m} has no assistant tokens")
                weight = share / n_tokens  # sft_loss: mean over the micro-batch's target tokens
            else:
                weight = share / len(chunk)  # the surrogate: a mean over samples (a row sums its samples')
            if not free:
                units.append(_Unit(t, (batch,), m, weight, len(units)))
                continue
            for i in range(batch.input_ids.shape[0]):
                units.append(_Unit(t, (_row(batch, i),), m, weight, len(units)))
        return units

    def _train_chunk(self, algorithm: str, units: list[_Unit], num_tenants: int, timing: _Timing) -> None:
        """One chunk (units sorted by slot): pack, forward (DPO: reference passes first),
        objective, backward into the tenants' grad rows."""
        p0 = time.perf_counter()
        pad = self.encoder.tok.pad_token_id
        generator = {u.tenant.work.tenant: u.tenant.generator for u in units}
        passes = []
        for k in range(len(units[0].blocks)):
            rows, batch = pack_blocks([u.tenant.work.tenant for u in units], [u.tenant.slot for u in units],
                                      [u.blocks[k] for u in units], pad)
            timing.real_tokens += int(batch.attention_mask.sum())
            timing.padded_tokens += batch.input_ids.numel()
            passes.append((rows, batch.to(self.device), tuple(generator[t] for t in rows.tenants)))
        timing.chunks += 1
        f0 = time.perf_counter()
        timing.prepare += f0 - p0
        refs = None
        if algorithm == "dpo":
            with torch.no_grad(), self.model.adapter_disabled():
                refs = [self._logprobs(*p) for p in passes]
        lps = [self._logprobs(*p) for p in passes]
        per_tenant = self._objective(algorithm, units, [b for _, b, _ in passes], lps, refs, num_tenants)
        b0 = time.perf_counter()
        with warnings.catch_warnings():
            # The per-site parameters are strided views of (K, P) memory and so are their grads,
            # on purpose (in-place accumulation into each tenant's grad row); torch warns about it.
            warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
            per_tenant.sum().backward()
        self.slots.fold_grads()
        self.model.bank.fused = None
        timing.losses.append(per_tenant.detach())
        timing.forward += b0 - f0
        timing.backward += time.perf_counter() - b0

    def _logprobs(self, rows: FusedRows, batch: TokenBatch, generators: tuple[torch.Generator, ...]) -> torch.Tensor:
        """One fused forward -> (R, T-1) log-probabilities of each row's next token where the
        loss reads them (`loss_mask` 1), 0 elsewhere."""
        self.model.bank.fused = FusedBinding(
            params=self.slots.params, scale=self.scale,
            meta=rows.segment_meta(batch.input_ids.shape[1], self.slots.capacity, self.device), backend=self.backend,
            rows=rows, dropout=self.model.spec.dropout, generators=generators)
        with self.trainer.autocast():
            return target_logprobs(self.model, self._head, batch)

    def _objective(self, algorithm: str, units: list[_Unit], batches: list[TokenBatch], lps: list[torch.Tensor],
                   refs: list[torch.Tensor] | None, num_tenants: int) -> torch.Tensor:
        """(num_tenants,): each tenant's part of the serial objective carried by this chunk
        (the module doc's per-sequence weights; `losses.py` has the same formulas per batch)."""
        dev = self.device
        if algorithm == "dpo":  # sequence logprobs of every row of every pass, passes concatenated
            seq = torch.cat([(lp * b.loss_mask).sum(-1) for lp, b in zip(lps, batches)])
            ref = torch.cat([(lp * b.loss_mask).sum(-1) for lp, b in zip(refs, batches)])
            base = [0]
            for b in batches:
                base.append(base[-1] + b.input_ids.shape[0])
            chosen, rejected, beta, weight, owner = [], [], [], [], []
            offset = [0] * len(batches)  # row of the current unit's block in each pass
            for u in units:
                for cb, cr, rb, rr in u.pairs:
                    chosen.append(base[cb] + offset[cb] + cr)
                    rejected.append(base[rb] + offset[rb] + rr)
                    beta.append(u.tenant.work.policy.dpo_beta)
                    weight.append(u.weight)
                    owner.append(u.tenant.index)
                for k, blk in enumerate(u.blocks):
                    offset[k] += blk.input_ids.shape[0]
            c, r = torch.tensor(chosen, device=dev), torch.tensor(rejected, device=dev)
            part = (dpo_pair_losses(seq[c], seq[r], ref[c], ref[r], torch.tensor(beta, device=dev))
                    * torch.tensor(weight, device=dev))
            return torch.zeros(num_tenants, device=dev).index_add(0, torch.tensor(owner, device=dev), part)
        (lp,), (b,) = lps, batches
        counts = [u.blocks[0].input_ids.shape[0] for u in units]

        def row(values: list) -> torch.Tensor:  # one value per unit -> one per row
            return torch.tensor([v for v, n in zip(values, counts) for _ in range(n)], device=dev)

        owner, weight, mask = row([u.tenant.index for u in units]), row([u.weight for u in units]), b.loss_mask
        if algorithm == "sft":
            part = -(lp * mask).sum(-1) * weight
        else:  # rl: the clipped surrogate per sequence, as `policy_gradient_loss` averages it
            behaviour = behaviour_or_current(b.behaviour_logprobs, lp)   # NaN: a unit without served ones
            eps = row([u.tenant.work.policy.rl_clip_eps for u in units]).unsqueeze(-1)
            part = clipped_surrogate(lp, behaviour, b.advantages, b.weights, eps) * weight
        return torch.zeros(num_tenants, device=dev).index_add(0, owner, part)


def _row(batch: TokenBatch, i: int) -> TokenBatch:
    """Row i of a right-padded batch cut to its own length (views)."""
    n = int(batch.attention_mask[i].sum())
    blp = batch.behaviour_logprobs
    cut = lambda t: None if t is None else t[i:i + 1, :n - 1]  # noqa: E731
    return TokenBatch(batch.input_ids[i:i + 1, :n], batch.attention_mask[i:i + 1, :n], cut(batch.loss_mask),
                      cut(blp), cut(batch.advantages), cut(batch.weights))

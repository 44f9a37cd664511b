"""One optimizer step for one tenant, and held-out evaluation.

Owns `TrainingPolicy` (a tenant's validated algorithm settings), `TrainerConfig` (settings
shared by every tenant on this learner) and `Trainer`. A step: make the tenant resident
(`AdapterStore.activate`), run the tenant's algorithm over micro-batches accumulating into
the tenant's grad row, then one AdamW update with the tenant's own step count and RNG.
Nothing here depends on which tenant trained before: that is what makes swaps exact.

`sft`, `dpo` and `rl` steps train one kind of example with one loss. `auto` and `kto` steps
are mixed (`clora.learner.mixed`): each example trains under its own term (SFT, DPO, grouped
or ungrouped policy gradient, KTO), each term weighted by the tenant's policy.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from clora.ingest.schemas import PreferencePair, RLSample, SFTExample
from clora.learner.adapter_store import AdapterStore
from clora.learner.batches import ChatEncoder, TokenBatch, micro_batches
from clora.learner.batches import Sequence as TokenSequence
from clora.learner.losses import (behaviour_or_current, clipped_surrogate, dpo_pair_losses, is_ungrouped, kto_kl,
                                  kto_losses, mismatched_pairs, policy_gradient_loss, sample_advantages,
                                  sample_weights, sequence_logprob, sft_loss, token_logprobs)
from clora.learner.lora import LoraModel
from clora.learner.mixed import StepPlan, plan_step
from clora.learner.optim import AdamConfig, adam_step

Algorithm = Literal["sft", "dpo", "rl", "kto", "auto"]
EXAMPLE_KINDS: dict[str, tuple[str, ...]] = {"sft": ("sft",), "dpo": ("preference",), "rl": ("rl",),
                                             "kto": ("rl",), "auto": ("sft", "preference", "rl")}
"""Which replay-buffer kinds each algorithm trains on (and, in this order, is gated on)."""
MIXED = ("kto", "auto")
"""Algorithms whose steps are mixed (`clora.learner.mixed`)."""


class TrainingPolicy(BaseModel):
    """A tenant's training settings (from the registry's LearningPolicy, plus learner-owned knobs)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    algorithm: Algorithm = "auto"
    learning_rate: float = Field(default=2e-4, gt=0, le=1.0)
    batch_size: int = Field(default=8, ge=1, le=1024)
    dpo_beta: float = Field(default=0.1, gt=0, le=100)
    """DPO temperature: how far the policy may move from the reference (base model)."""
    rl_clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO/GRPO clip range of the importance ratio pi / pi_behaviour."""
    unpaired: Literal["pg", "kto"] = "pg"
    """`auto`: how an ungrouped scored sample trains (see `clora.registry.LearningPolicy`)."""
    kto_beta: float = Field(default=0.1, gt=0, le=100)
    kto_desirable_weight: float = Field(default=1.0, gt=0, le=100)
    kto_undesirable_weight: float = Field(default=1.0, gt=0, le=100)
    desirable_reward: float = Field(default=0.5, ge=-1e6, le=1e6)
    reward_baseline_momentum: float = Field(default=0.9, ge=0, lt=1)
    sft_weight: float = Field(default=1.0, ge=0, le=100)
    dpo_weight: float = Field(default=1.0, ge=0, le=100)
    pg_weight: float = Field(default=1.0, ge=0, le=100)
    kto_weight: float = Field(default=1.0, ge=0, le=100)
    eval_tolerance: float = Field(default=0.02, ge=0, le=1)
    """Publish when new eval loss <= live eval loss * (1 + tolerance)."""
    fresh_fraction: float | None = Field(default=None, ge=0, le=1)
    """Share of a batch from not-yet-seen examples (None: the learner's setting)."""


class TrainerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(default=8, ge=1)
    """Examples per forward/backward; a step's batch is split into micro-batches."""
    max_seq_len: int = Field(default=512, ge=8)
    adam: AdamConfig = AdamConfig()
    autocast: Literal["off", "bfloat16"] = "off"
    """`bfloat16`: every forward's matrix products run in bf16 (`torch.autocast`), while the
    weights, gradients, optimizer state and log-softmax stay fp32 (`LearnerSettings.autocast`)."""


@contextlib.contextmanager
def autocast(device: torch.device, mode: str) -> Iterator[None]:
    """`TrainerConfig.autocast`'s context for a forward pass on `device` ("off": none)."""
    if mode == "off":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=getattr(torch, mode)):
        yield


@dataclass(frozen=True)
class StepResult:
    tenant: str
    step: int
    loss: float
    grad_norm: float
    examples: int
    tokens: int
    seconds: float
    rows: int | None = None
    """Sequences the forwards ran (RL: fewer than `examples` when an episode's turns packed)."""


Example = SFTExample | PreferencePair | RLSample


def plain_lm_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when the causal LM's logits are just `lm_head(decoder(...).last_hidden_state)`
    (Llama, SmolLM2, Qwen2, Mistral), so the head can run on the positions a loss reads only:
    the LM head is ~20% of SmolLM2's compute per token and prompt positions never need it.
    None (full forward) for models that post-process logits (softcapping, logit scale)."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, a, None) not in (None, 1.0) for a in ("final_logit_softcapping", "logit_scale",
                                                              "output_multiplier_scale", "logits_scaling")):
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or decoder is model or type(head) is not torch.nn.Linear:
        return None
    return decoder, head


SHARED_PREFIX_MIN_TOKENS = 16
"""Shorter common prefixes are run per row: one more forward call costs more than it saves."""


def shared_prefix_len(batch: TokenBatch) -> int:
    """How many leading positions every row of `batch` has in common (same tokens, attended)
    and no loss reads (a position's hidden state scores the next token): those can run once
    for the whole batch. 0 when fewer than `SHARED_PREFIX_MIN_TOKENS` or a single row."""
    ids = batch.input_ids
    if ids.shape[0] < 2:
        return 0
    same = ((ids == ids[:1]).all(0) & batch.attention_mask.bool().all(0)).tolist()
    common = same.index(False) if False in same else len(same)
    read = batch.loss_mask.bool().any(0).tolist()
    first_read = read.index(True) if True in read else len(read)
    n = min(common, first_read, ids.shape[1] - 1)
    return n if n >= SHARED_PREFIX_MIN_TOKENS else 0


def target_logprobs(model: LoraModel, head: tuple[torch.nn.Module, torch.nn.Linear] | None,
                    batch: TokenBatch, *, share_prefix: bool = False) -> torch.Tensor:
    """(B, T-1) log p of each next token where `batch.loss_mask` is 1, 0 elsewhere. With a
    `plain_lm_head` split the head runs on those positions only; without, the full forward.

    `share_prefix` (only where every row runs the same adapter): the rows' common prompt
    (`shared_prefix_len`: a system prompt and tool listing, a GRPO group's question) runs once
    and the rows continue from its keys and values, which the backward pass reaches through
    as it would through P separate copies. Same result, less arithmetic: a group of 4 episodes
    of one calc problem shares most of its tokens.

    A model that computes these itself (the megatron backend's) does."""
    if hasattr(model, "target_logprobs"):
        return model.target_logprobs(batch)
    if head is None:
        return token_logprobs(model(batch.input_ids, batch.attention_mask), batch.input_ids)
    decoder, lm_head = head
    p = shared_prefix_len(batch) if share_prefix else 0
    if p:
        rows, length = batch.input_ids.shape
        cache = decoder(input_ids=batch.input_ids[:1, :p], use_cache=True).past_key_values
        cache.batch_repeat_interleave(rows)
        positions = torch.arange(p, length, device=batch.input_ids.device).expand(rows, -1)
        hidden = decoder(input_ids=batch.input_ids[:, p:], attention_mask=batch.attention_mask,
                         position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
    else:
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         use_cache=False).last_hidden_state  # (B, T, H)
    where = batch.loss_mask.bool()  # (B, T-1)
    logits = lm_head(hidden[:, :-1][where[:, p:]])  # (N, V): only the N positions a loss reads
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.input_ids[:, 1:][where].unsqueeze(-1))
    return torch.zeros(where.shape, dtype=lp.dtype, device=lp.device).masked_scatter(where, lp.squeeze(-1))


class Trainer:
    def __init__(self, model: LoraModel, encoder: ChatEncoder, store: AdapterStore, cfg: TrainerConfig = TrainerConfig()):
        self.model = model
        self.encoder = encoder
        self.store = store
        self.cfg = cfg
        self.device = store.device
        self._head = plain_lm_head(model.model)   # the LM head on target positions only, when it can

    # --- losses -------------------------------------------------------------------------------

    def _logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(B, T-1) log-probabilities where the loss reads them (loss_mask 1), 0 elsewhere."""
        # One adapter for every row. Not with LoRA dropout in training: a shared prompt would get
        # one dropout mask for all rows instead of one each.
        share = not (self.model.training and self.model.spec.dropout > 0)
        with self.autocast():
            return target_logprobs(self.model, self._head, batch, share_prefix=share)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward passes' autocast context (`TrainerConfig.autocast`)."""
        return autocast(self.device, self.cfg.autocast)

    def _loss(self, examples: Sequence[Example], policy: TrainingPolicy,
              advantages: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
        """The algorithm's loss on `examples`, the number of target tokens and of rows run."""
        enc, dev = self.encoder, self.device
        if policy.algorithm == "sft":
            b = enc.sft(list(examples)).to(dev)
            return sft_loss(self._logprobs(b), b.loss_mask), b.num_target_tokens, len(examples)
        if policy.algorithm == "dpo":
            chosen, rejected = (x.to(dev) for x in enc.preference(list(examples)))
            return (self._dpo_pair_losses(chosen, rejected, policy.dpo_beta).mean(),
                    chosen.num_target_tokens + rejected.num_target_tokens, 2 * len(examples))
        b = enc.rl(list(examples), advantages).to(dev)  # an episode's turns share a row
        lp = self._logprobs(b)
        behaviour = behaviour_or_current(b.behaviour_logprobs, lp)
        return (policy_gradient_loss(lp, behaviour, b.advantages, b.weights, b.samples, policy.rl_clip_eps),
                b.num_target_tokens, b.input_ids.shape[0])

    def _dpo_pair_losses(self, chosen: TokenBatch, rejected: TokenBatch, beta: float) -> torch.Tensor:
        """(B,) DPO loss of each pair, the reference being the base model (adapter disabled)."""
        with torch.no_grad(), self.model.adapter_disabled():
            ref_c = sequence_logprob(self._logprobs(chosen), chosen.loss_mask)
            ref_r = sequence_logprob(self._logprobs(rejected), rejected.loss_mask)
        return dpo_pair_losses(sequence_logprob(self._logprobs(chosen), chosen.loss_mask),
                               sequence_logprob(self._logprobs(rejected), rejected.loss_mask), ref_c, ref_r, beta)

    def _kto_losses(self, samples: Sequence[RLSample], policy: TrainingPolicy) -> torch.Tensor:
        """(B,) KTO loss of each scored sample (`losses.kto_losses`): desirable when its reward is
        at least `desirable_reward`. The reference is the base model with the adapter disabled,
        as for DPO, and as TRL's KTOTrainer takes it for a PEFT model without a separate
        reference: the tenant's adapter is all that trains, so the base is the policy it started
        from, and it costs no second copy of the model. The reference point z0 is estimated as
        TRL does, on the same B completions paired with the previous sample's prompt
        (`mismatched_pairs`), within this micro-batch (TRL: within the device batch)."""
        enc, dev = self.encoder, self.device
        seqs = [enc.encode_rl(s) for s in samples]
        matched = enc.collate([TokenSequence(q.prompt_ids, q.completion_ids) for q in seqs]).to(dev)
        kl_batch = enc.collate([TokenSequence(seqs[i].prompt_ids, seqs[j].completion_ids)
                                for i, j in enumerate(mismatched_pairs(len(seqs)))]).to(dev)
        with torch.no_grad():
            policy_kl = sequence_logprob(self._logprobs(kl_batch), kl_batch.loss_mask)
            with self.model.adapter_disabled():
                ref = sequence_logprob(self._logprobs(matched), matched.loss_mask)
                ref_kl = sequence_logprob(self._logprobs(kl_batch), kl_batch.loss_mask)
        desirable = torch.tensor([s.reward >= policy.desirable_reward for s in samples], device=ref.device)
        return kto_losses(sequence_logprob(self._logprobs(matched), matched.loss_mask), ref, desirable,
                          kto_kl(policy_kl, ref_kl), policy.kto_beta, policy.kto_desirable_weight,
                          policy.kto_undesirable_weight)

    def _mixed_loss(self, examples: Sequence[Example], idx: list[int], plan: StepPlan,
                    policy: TrainingPolicy) -> tuple[torch.Tensor, int, int]:
        """Micro-batch `idx` of a mixed step's share of the step objective (`clora.learner.mixed`):
        each term's loss on its examples here, times its weight and its share of the step's
        examples of that term. The target tokens and rows run, as `_loss`."""
        enc, dev = self.encoder, self.device
        by_term: dict[str, list[int]] = {}
        for i in idx:
            by_term.setdefault(plan.terms[i], []).append(i)
        loss, tokens, rows = torch.zeros((), device=dev), 0, 0
        for term, members in by_term.items():
            weight = getattr(policy, f"{term}_weight")
            if weight == 0:
                continue
            part = [examples[i] for i in members]
            share = weight * len(part) / plan.count(term)
            if term == "sft":
                b = enc.sft(part).to(dev)
                loss = loss + share * sft_loss(self._logprobs(b), b.loss_mask)
                tokens, rows = tokens + b.num_target_tokens, rows + len(part)
            elif term == "dpo":
                chosen, rejected = (x.to(dev) for x in enc.preference(part))
                loss = loss + share * self._dpo_pair_losses(chosen, rejected, policy.dpo_beta).mean()
                tokens, rows = tokens + chosen.num_target_tokens + rejected.num_target_tokens, rows + 2 * len(part)
            elif term == "pg":  # the clipped surrogate `policy_gradient_loss` of the `rl` step
                b = enc.rl(part, plan.advantages[members]).to(dev)
                lp = self._logprobs(b)
                surrogate = clipped_surrogate(lp, behaviour_or_current(b.behaviour_logprobs, lp), b.advantages,
                                              b.weights, policy.rl_clip_eps)
                loss = loss + share * surrogate.sum() / b.samples
                tokens, rows = tokens + b.num_target_tokens, rows + b.input_ids.shape[0]
            else:
                loss = loss + share * self._kto_losses(part, policy).mean()
                n = sum(len(enc.encode_rl(s).completion_ids) for s in part)
                tokens, rows = tokens + n, rows + 3 * len(part)
        return loss, tokens, rows

    # --- training -----------------------------------------------------------------------------

    def train_step(self, tenant: str, examples: Sequence[Example], policy: TrainingPolicy,
                   prefetch: str | None = None) -> StepResult:
        """One optimizer step of `tenant` on `examples` (all of the algorithm's kind). When
        `prefetch` names the next tenant, its state loads in the background during this step."""
        if not examples:
            raise ValueError(f"train_step for {tenant!r} got no examples")
        t0 = time.perf_counter()
        slot = self.store.activate(tenant)
        if prefetch is not None:
            self.store.prefetch(prefetch)
        st = self.store.peek(tenant)
        gen = st.generator()
        self.model.bank.dropout_generator = gen
        advantages, plan = None, None
        if policy.algorithm == "rl":
            advantages = sample_advantages(examples)
        elif policy.algorithm in MIXED:
            plan = plan_step(examples, policy.algorithm, policy.unpaired, st.reward_baseline,
                             policy.reward_baseline_momentum)
        self.model.train()
        total, tokens, rows, mb = 0.0, 0, 0, self.cfg.micro_batch_size
        try:
            for idx in micro_batches(self.encoder, list(examples), mb):  # RL: an episode's turns together
                chunk = [examples[i] for i in idx]
                if plan is not None:  # already the micro-batch's share of the step objective
                    loss, n, r = self._mixed_loss(examples, idx, plan, policy)
                    scaled = loss
                else:
                    adv = advantages[idx] if advantages is not None else None
                    loss, n, r = self._loss(chunk, policy, adv)
                    scaled = loss * (len(chunk) / len(examples))
                if scaled.requires_grad:  # a mixed micro-batch whose terms all weigh 0 has no graph
                    scaled.backward()
                slot.fold_grads()
                st.micro_steps += 1
                total += float(scaled.detach())
                tokens += n
                rows += r
            st.step += 1
            norm = adam_step(slot, st.step, policy.learning_rate, self.cfg.adam)
            slot.sync_weights()
        finally:
            self.model.eval()
            self.model.bank.dropout_generator = None
        st.micro_steps = 0
        st.examples_seen += len(examples)
        if plan is not None:
            st.reward_baseline = plan.baseline
        st.save_generator(gen)
        return StepResult(tenant, st.step, total, norm, len(examples), tokens, time.perf_counter() - t0, rows)

    # --- evaluation ---------------------------------------------------------------------------

    def eval_loss(self, tenant: str, examples: Sequence[Example], policy: TrainingPolicy,
                  weights: torch.Tensor | None = None) -> float:
        """Held-out loss (lower is better) of `tenant`'s current adapter, or of `weights` (P,)
        given instead (e.g. the live version's): the mean of `example_losses` over what
        `eval_examples` scores."""
        if not examples:
            raise ValueError(f"eval_loss for {tenant!r} got no held-out examples")
        scored, how = self.eval_examples(examples, policy)
        return statistics.fmean(self.example_losses(tenant, scored, how, weights))

    @staticmethod
    def eval_examples(examples: Sequence[Example], policy: TrainingPolicy) -> tuple[list[Example], TrainingPolicy]:
        """What a held-out loss scores, and with which loss: SFT and DPO examples as given; RL
        the completions that beat their group's mean reward (all of them when no group has a
        spread), as SFT examples (their NLL). Under `auto` and `kto` (held-out examples of one
        kind, `EXAMPLE_KINDS`' first with any): SFT examples and pairs under their own loss;
        scored samples the desirable ones (reward >= `desirable_reward`; under `auto` a grouped
        one that beat its group's mean), as SFT examples."""
        if policy.algorithm in ("sft", "dpo"):
            return list(examples), policy
        if policy.algorithm in MIXED and examples and examples[0].kind != "rl":
            return list(examples), policy.model_copy(update={"algorithm": "sft" if examples[0].kind == "sft" else "dpo"})
        adv = sample_advantages(examples)
        if policy.algorithm in MIXED:
            good = [s for s, a in zip(examples, adv) if (a > 0 if policy.algorithm == "auto" and not is_ungrouped(s)
                                                          else s.reward >= policy.desirable_reward)]
        else:
            good = [s for s, a in zip(examples, adv) if a > 0]
        good = good or list(examples)
        return ([SFTExample(example_id=s.example_id, tenant=s.tenant, interaction_id=s.interaction_id,
                            feedback_event_id=s.feedback_event_id, time=s.time, messages=s.messages, target=s.response)
                 for s in good], policy.model_copy(update={"algorithm": "sft"}))

    @torch.no_grad()
    def example_losses(self, tenant: str, examples: Sequence[Example], policy: TrainingPolicy,
                       weights: torch.Tensor | None = None) -> list[float]:
        """Each example's loss under `tenant`'s adapter (or `weights`): SFT the mean NLL of its
        target tokens, DPO its pair's DPO loss against the base model. One example's loss does
        not depend on the others, so a gate can keep the live version's per example."""
        if policy.algorithm not in ("sft", "dpo"):
            raise ValueError(f"example_losses scores SFT and DPO examples, not {policy.algorithm!r}")
        out: list[float] = []
        enc, dev, mb = self.encoder, self.device, self.cfg.micro_batch_size
        with self._weights(tenant, weights):
            for i in range(0, len(examples), mb):
                chunk = list(examples[i:i + mb])
                if policy.algorithm == "sft":
                    b = enc.sft(chunk).to(dev)
                    per = -(self._logprobs(b) * sample_weights(b.loss_mask)).sum(-1)  # each row's token mean
                else:
                    per = self._dpo_pair_losses(*(x.to(dev) for x in enc.preference(chunk)), policy.dpo_beta)
                out += per.tolist()
        return out

    @contextlib.contextmanager
    def _weights(self, tenant: str, weights: torch.Tensor | None) -> Iterator[None]:
        slot = self.store.activate(tenant)
        if weights is None:
            yield
            return
        master = slot.master
        backup = master.clone()
        master.copy_(weights.to(master.device))
        slot.sync_weights()
        try:
            yield
        finally:
            master.copy_(backup)
            slot.sync_weights()

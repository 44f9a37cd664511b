"""One optimizer step for one tenant, and held-out evaluation.

Owns `TrainingPolicy` (a tenant's validated algorithm settings), `TrainerConfig` (settings
shared by every tenant on this learner) and `Trainer`. A step: make the tenant resident
(`AdapterStore.activate`), run the tenant's algorithm over micro-batches accumulating into
the tenant's grad row, then one AdamW update with the tenant's own step count and RNG.
Nothing here depends on which tenant trained before: that is what makes swaps exact.
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
from clora.learner.losses import (behaviour_or_current, dpo_pair_losses, policy_gradient_loss, sample_advantages,
                                  sample_weights, sequence_logprob, sft_loss, token_logprobs)
from clora.learner.lora import LoraModel
from clora.learner.optim import AdamConfig, adam_step

Algorithm = Literal["sft", "dpo", "rl"]
EXAMPLE_KIND: dict[str, str] = {"sft": "sft", "dpo": "preference", "rl": "rl"}
"""Which replay-buffer kind each algorithm trains on."""


class TrainingPolicy(BaseModel):
    """A tenant's training settings (from the registry's LearningPolicy, plus learner-owned knobs)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    algorithm: Algorithm = "sft"
    learning_rate: float = Field(default=2e-4, gt=0, le=1.0)
    batch_size: int = Field(default=8, ge=1, le=1024)
    dpo_beta: float = Field(default=0.1, gt=0, le=100)
    """DPO temperature: how far the policy may move from the reference (base model)."""
    rl_clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO/GRPO clip range of the importance ratio pi / pi_behaviour."""
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
    of one calc problem shares most of its tokens."""
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
        return target_logprobs(self.model, self._head, batch, share_prefix=share)

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
        advantages = None
        if policy.algorithm == "rl":
            advantages = sample_advantages(examples)
        self.model.train()
        total, tokens, rows, mb = 0.0, 0, 0, self.cfg.micro_batch_size
        try:
            for idx in micro_batches(self.encoder, list(examples), mb):  # RL: an episode's turns together
                chunk = [examples[i] for i in idx]
                adv = advantages[idx] if advantages is not None else None
                loss, n, r = self._loss(chunk, policy, adv)
                (loss * (len(chunk) / len(examples))).backward()
                slot.fold_grads()
                st.micro_steps += 1
                total += float(loss.detach()) * len(chunk) / len(examples)
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
        spread), as SFT examples (their NLL)."""
        if policy.algorithm != "rl":
            return list(examples), policy
        adv = sample_advantages(examples)
        good = [s for s, a in zip(examples, adv) if a > 0] or list(examples)
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

"""Where a Tinker model's training runs: the `TrainingBackend` protocol and its in-process backend.

A Tinker model is a **named run under a tenant** (clora.trainapi's package docstring): its
adapter state is one more entry of the learner's swapped store, keyed `run_key(tenant,
model_id)`, so a research loop never overwrites the tenant's continuously learned adapter.

`InProcessBackend` runs the requests on a `Trainer`'s model and `AdapterStore`: the same LoRA
layout, the same swapped per-run state (master weights, Adam moments, grad row, RNG) and the
same AdamW (`clora.learner.optim.adam_step`). The learner process holds one, driven by
`clora.trainapi.executor.TinkerWork` when its scheduler picks a run, one request at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from clora.learner.adapter_store import GRAD, MASTER, ROWS, AdapterState
from clora.learner.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from clora.learner.optim import AdamConfig, adam_step
from clora.learner.peft_io import read_adapter, write_adapter
from clora.learner.trainer import Trainer
from clora.trainapi.losses import tinker_loss
from clora.trainapi.wire import ForwardBackwardResult, TinkerDatum

ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP = frozenset({"gate_proj", "up_proj", "down_proj"})


def run_key(tenant: str, model_id: str) -> str:
    """The store key of a Tinker model's state. Example: ("acme", "9f..:train:0") ->
    "acme/tinker/9f..:train:0" (a tenant id holds no "/", so no run key is a tenant's)."""
    return f"{tenant}/tinker/{model_id}"


@dataclass(frozen=True)
class LoraCapabilities:
    """The adapters a backend can hold. `create_model` is checked against these."""

    rank: int
    alpha: float
    train_attn: bool
    """Every attention projection (q, k, v, o) is adapted."""
    train_mlp: bool
    """Every MLP projection (gate, up, down) is adapted."""
    vocab_size: int


@dataclass(frozen=True)
class AdamParams:
    """`optim_step`'s `adam_params` as the SDK sends them (all six, always)."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    """Decoupled, as torch's AdamW."""
    grad_clip_norm: float
    """0: no clipping."""


class TrainingBackend(Protocol):
    """Runs a Tinker model's requests. Errors raised are reported in the request's future."""

    def capabilities(self) -> LoraCapabilities: ...

    def create(self, key: str, seed: int) -> None:
        """A new run under `key` from a fresh LoRA init (seeded); nothing if it exists."""

    def forward_backward(self, key: str, data: Sequence[TinkerDatum], loss_fn: str,
                         config: Mapping[str, float | str], forward_only: bool) -> ForwardBackwardResult:
        """Each datum's target logprobs and the summed loss; unless `forward_only`, the loss's
        gradient added to the run's accumulated gradient."""

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        """One AdamW step from the accumulated gradient, which it then zeroes; metrics."""

    def save_state(self, key: str, folder: Path, base_model: str, optimizer: bool) -> int:
        """Write the run's adapter into the existing `folder` as PEFT files and, with `optimizer`,
        its whole training state (Adam moments, step, RNG) as `state.safetensors`; its step."""

    def load_state(self, key: str, folder: Path, optimizer: bool) -> None:
        """Set the run's weights to those saved in `folder`, dropping any accumulated gradient:
        with `optimizer` its Adam moments, step and RNG too, else fresh Adam state (step 0)."""


class InProcessBackend:
    """`TrainingBackend` on a `Trainer`'s model and store, in this process."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.store, self.model = trainer.store, trainer.model
        spec = self.model.spec
        targets = frozenset(spec.target_modules)
        self._caps = LoraCapabilities(spec.rank, spec.alpha, ATTENTION <= targets, MLP <= targets, self.model.vocab_size)

    def capabilities(self) -> LoraCapabilities:
        return self._caps

    def create(self, key: str, seed: int) -> None:
        self.store.register(key, seed)

    def forward_backward(self, key: str, data: Sequence[TinkerDatum], loss_fn: str,
                         config: Mapping[str, float | str], forward_only: bool) -> ForwardBackwardResult:
        slot = self.store.activate(key)
        st = self.store.peek(key)
        gen = st.generator()
        mb = self.trainer.cfg.micro_batch_size
        logprobs: list[np.ndarray] = []
        total = 0.0
        if not forward_only:
            self.model.train()
            self.model.bank.dropout_generator = gen
        grad = contextlib.nullcontext() if not forward_only else torch.no_grad()
        try:
            with grad:
                for i in range(0, len(data), mb):
                    chunk = data[i:i + mb]
                    p, mask, inputs = self._target_logprobs(chunk)
                    loss = tinker_loss(loss_fn, p, inputs, mask, config)
                    if not math.isfinite(float(loss.detach())):
                        raise FloatingPointError(f"{loss_fn} loss is {float(loss)} on datums {i}..{i + len(chunk) - 1}")
                    if not forward_only:
                        loss.backward()
                        slot.fold_grads()
                        st.micro_steps += 1
                    total += float(loss.detach())
                    logprobs += [p[j, :d.tokens.size].detach().cpu().numpy().astype(np.float32)
                                 for j, d in enumerate(chunk)]
        finally:
            self.model.eval()
            self.model.bank.dropout_generator = None
            if not forward_only:
                st.save_generator(gen)
        return ForwardBackwardResult(tuple(logprobs), {"loss:sum": total})

    def _target_logprobs(self, data: Sequence[TinkerDatum]
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(B, T) logprob of each datum's `target_tokens` under the resident adapter (position i
        of the input predicts target i), the (B, T) mask of real positions, and the float
        inputs padded to (B, T) with zeros."""
        dev = self.store.device
        length = max(d.tokens.size for d in data)
        ids = torch.zeros(len(data), length, dtype=torch.long)
        targets = torch.zeros(len(data), length, dtype=torch.long)
        mask = torch.zeros(len(data), length)
        inputs: dict[str, torch.Tensor] = {}
        for j, d in enumerate(data):
            n = d.tokens.size
            ids[j, :n] = torch.from_numpy(d.tokens)
            targets[j, :n] = torch.from_numpy(d.inputs["target_tokens"])
            mask[j, :n] = 1
            for name, values in d.inputs.items():
                if name != "target_tokens":
                    inputs.setdefault(name, torch.zeros(len(data), length))[j, :n] = torch.from_numpy(values)
        ids, targets, mask = ids.to(dev), targets.to(dev), mask.to(dev)
        logits = self.model(ids, mask.long())  # (B, T, V)
        p = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
        return p, mask, {k: v.to(dev) for k, v in inputs.items()}

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        slot = self.store.activate(key)
        st = self.store.peek(key)
        cfg = AdamConfig(beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps, weight_decay=adam.weight_decay,
                         max_grad_norm=adam.grad_clip_norm or None)
        norm = adam_step(slot, st.step + 1, adam.learning_rate, cfg)   # raises before changing anything
        st.step += 1
        st.micro_steps = 0
        slot.sync_weights()
        return {"grad_norm:mean": norm, "step:max": float(st.step)}

    def save_state(self, key: str, folder: Path, base_model: str, optimizer: bool) -> int:
        st = self.store.state(key)   # the host copy, flushed from the device
        write_adapter(folder, self.model.layout, st.master, base_model)
        if optimizer:   # the learner's checkpoint format, named for the folder rather than the run
            save_checkpoint(folder, dataclasses.replace(st, tenant="state"), self.model.layout.numel)
        return st.step

    def load_state(self, key: str, folder: Path, optimizer: bool) -> None:
        layout = self.model.layout
        cur = self.store.peek(key)
        if optimizer:
            saved = load_checkpoint(checkpoint_path(folder, "state"), layout.numel)
            new = dataclasses.replace(saved, tenant=key, micro_steps=0)
            new.buffer[GRAD].zero_()
        else:
            buffer = torch.zeros(ROWS, layout.numel, dtype=torch.float32)   # (4, P)
            buffer[MASTER].copy_(read_adapter(folder, layout))
            new = AdapterState(tenant=key, seed=cur.seed, buffer=buffer, rng_state=cur.rng_state.clone(),
                               examples_seen=cur.examples_seen)
        self.store.put(new)   # replaces the run's state, resident copy included

"""LoRA on the frozen base model, with all of one adapter's weights in one flat buffer.

Owns:
- `LoraSpec`: rank, alpha, target modules, dropout (validated).
- `LoraLayout`: where each adapted projection's A and B live inside a flat vector of
  `numel` floats. Offsets are fixed for a given (base model, spec), so a tenant's whole
  adapter state is a handful of contiguous tensors that swap with one copy each.
- `LoraModel`: the base model with every target `nn.Linear` wrapped by `LoraLinear`. The
  wrappers read their A/B from a shared `LoraBank`; pointing the bank at another set of
  views (`bind`) switches the adapter in O(1), with no per-layer Python work.

Per adapted linear (in_features -> out_features), exactly as PEFT computes it:
    y = base(x) + B(A(dropout(x))) * alpha / rank      A: (rank, in)   B: (out, rank)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(BaseModel):
    """Shape of one adapter. Every tenant on one learner shares target modules; rank and
    alpha come from the tenant's policy but must fit the learner's layout (see AdapterStore)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(default=8, ge=1, le=512)
    """LoRA rank r (vLLM serves 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: the update is scaled by alpha / rank."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Leaf names of the nn.Linear modules to adapt (attention and MLP projections)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """LoRA dropout on the adapter input; uses the tenant's own RNG, so swaps stay exact."""

    @field_validator("target_modules")
    @classmethod
    def _nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("target_modules must name at least one module")
        return tuple(v)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class LoraSite:
    """One adapted projection. Example: `name` "model.layers.0.self_attn.k_proj", in 64, out 32,
    rank 8: A occupies flat[a_offset : a_offset + 8*64], B flat[b_offset : b_offset + 32*8]."""

    name: str
    in_features: int
    out_features: int
    a_offset: int
    b_offset: int


@dataclass(frozen=True)
class LoraLayout:
    """Where every A and B lives in an adapter's flat vector (`numel` elements)."""

    spec: LoraSpec
    sites: tuple[LoraSite, ...]
    numel: int

    @classmethod
    def for_model(cls, model: nn.Module, spec: LoraSpec) -> "LoraLayout":
        sites, off, r = [], 0, spec.rank
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in spec.target_modules and isinstance(mod, (nn.Linear, LoraLinear)):
                base = mod.base if isinstance(mod, LoraLinear) else mod
                a_off, b_off = off, off + r * base.in_features
                off = b_off + base.out_features * r
                sites.append(LoraSite(name, base.in_features, base.out_features, a_off, b_off))
        if not sites:
            raise ValueError(f"no nn.Linear named any of {spec.target_modules} in {type(model).__name__}")
        return cls(spec, tuple(sites), off)

    def views(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) views into `flat` (shape (numel,)) for every site, in site order."""
        r = self.spec.rank
        return [
            (flat[s.a_offset:s.a_offset + r * s.in_features].view(r, s.in_features),
             flat[s.b_offset:s.b_offset + s.out_features * r].view(s.out_features, r))
            for s in self.sites
        ]

    def init_(self, flat: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """PEFT's default init, drawn from `generator`: A ~ U(+-1/sqrt(in)) (kaiming_uniform with
        a=sqrt(5)), B = 0, so a fresh adapter leaves the base model's output unchanged."""
        flat.zero_()
        for s, (a, _) in zip(self.sites, self.views(flat)):
            bound = 1.0 / math.sqrt(s.in_features)
            a.copy_(torch.rand(a.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound)
        return flat

    # --- PEFT format -----------------------------------------------------------------------

    def peft_state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keys exactly as PEFT saves them: `base_model.model.<module path>.lora_A.weight`."""
        out = {}
        for s, (a, b) in zip(self.sites, self.views(flat.detach().to("cpu", torch.float32))):
            out[f"base_model.model.{s.name}.lora_A.weight"] = a.contiguous().clone()
            out[f"base_model.model.{s.name}.lora_B.weight"] = b.contiguous().clone()
        return out

    def flat_from_peft(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `peft_state_dict`. Every expected key must be present with its shape and
        no other key may be: a prefix mismatch must fail loudly, never load nothing."""
        expected = {}
        for s, (a, b) in zip(self.sites, self.views(torch.empty(self.numel))):
            expected[f"base_model.model.{s.name}.lora_A.weight"] = (s.a_offset, a.shape)
            expected[f"base_model.model.{s.name}.lora_B.weight"] = (s.b_offset, b.shape)
        keys = set(tensors)
        missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected))
        if missing or unexpected:
            raise KeyError(f"adapter keys do not match the layout ({len(expected)} expected): "
                           f"{len(missing)} missing e.g. {missing[:2]}, {len(unexpected)} unexpected e.g. {unexpected[:2]}")
        flat = torch.empty(self.numel, dtype=torch.float32)
        for key, (off, shape) in expected.items():
            t = tensors[key]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key} has shape {tuple(t.shape)}, layout expects {tuple(shape)}")
            flat[off:off + t.numel()] = t.reshape(-1).to(torch.float32)
        return flat


def dropout_keep(shape: torch.Size, p: float, generator: torch.Generator | None,
                 device: torch.device) -> torch.Tensor:
    """LoRA dropout's keep mask (bool, `shape`) on `device`, drawn from the tenant's generator.

    Tenant generators live on the CPU (their state is swapped with the adapter), and torch
    refuses a CPU generator for a CUDA draw, so on an accelerator the mask is drawn on the CPU
    and copied over: the same mask as a CPU run, whatever device trains.
    """
    if generator is None or generator.device.type == torch.device(device).type:
        return torch.rand(shape, generator=generator, device=device) >= p
    return (torch.rand(shape, generator=generator) >= p).to(device, non_blocking=True)


class LoraBank:
    """What every LoraLinear reads: the bound (A, B) parameters, and whether LoRA is enabled."""

    def __init__(self, spec: LoraSpec):
        self.spec = spec
        self.params: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.enabled = True
        self.dropout_generator: torch.Generator | None = None
        self.fused = None
        """A `clora.learner.fused_batch.FusedBinding` during a fused multi-tenant forward (then it
        takes precedence over `params`), else None."""


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus the LoRA update of site `index` from the shared bank."""

    def __init__(self, base: nn.Linear, bank: LoraBank, index: int):
        super().__init__()
        self.base = base
        self.bank = bank
        self.index = index

    @property
    def weight(self) -> torch.Tensor:  # some HF code inspects proj.weight (dtype/device)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        y = self.base(x)  # (..., out)
        bank = self.bank
        if not bank.enabled:
            return y
        if bank.fused is not None:  # several tenants in one batch: the segmented kernels
            return y + bank.fused.delta(self.index, x, self.training).to(y.dtype)
        if bank.params is None:
            return y
        a, b = bank.params[self.index]  # (r, in), (out, r)
        if bank.spec.dropout > 0 and self.training:
            x = x * dropout_keep(x.shape, bank.spec.dropout, bank.dropout_generator, x.device) / (1 - bank.spec.dropout)
        h = F.linear(x.to(a.dtype), a)  # (..., r)
        if h.dtype != y.dtype:
            return y + F.linear(h, b).to(y.dtype) * bank.spec.scaling
        # y + scaling * (h @ B^T) as one GEMM accumulating onto y: the scale, the product and
        # the sum as separate ops were three passes (and allocations) over (tokens, out), which
        # on CPU cost the learner more than the rank-r products themselves
        return torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), b.t(),
                           alpha=bank.spec.scaling).view(y.shape)


class LoraModel(nn.Module):
    """The frozen base model with LoRA wrappers on the target projections."""

    def __init__(self, base_model: nn.Module, spec: LoraSpec):
        super().__init__()
        base_model.requires_grad_(False)
        self.layout = LoraLayout.for_model(base_model, spec)
        self.bank = LoraBank(spec)
        for i, site in enumerate(self.layout.sites):
            parent_name, _, leaf = site.name.rpartition(".")
            parent = base_model.get_submodule(parent_name)
            setattr(parent, leaf, LoraLinear(getattr(parent, leaf), self.bank, i))
        self.model = base_model
        self.eval()   # no LoRA dropout outside a training step (which switches to train mode)

    @property
    def spec(self) -> LoraSpec:
        return self.layout.spec

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def bind(self, params: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Point every LoraLinear at these (A, B) tensors (from `layout.views`); None = base only."""
        self.bank.params = params

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The base model alone (DPO's reference policy): no second model in memory."""
        prev, self.bank.enabled = self.bank.enabled, False
        try:
            yield
        finally:
            self.bank.enabled = prev

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for input_ids (batch, seq)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

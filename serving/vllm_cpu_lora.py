"""Replacement for vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops.lora_ops`, used by
`PunicaWrapperCPU`), installed into every replica process by the hook `clora.serving.vllm_launch`
writes.

Why. vLLM's torch ops compute every row as `einsum(x[t], W[idx[t]])` after gathering a full
copy of the adapter matrix for each token: `(tokens, rank, in)` and `(tokens, out, rank)`
per layer and module. In prefill that is megabytes of copies per module, which is most of
the multi-LoRA overhead on CPU. They also index with -1 for rows without an adapter, which
Python indexing turns into the *last* slot (base rows get someone's adapter).

What. Same signatures and results, with rows grouped by slot:

    Semantics (shrink): y[t, :r] = scale * x[t] @ A[idx[t]].T      (0 where idx[t] < 0)
    Semantics (expand): y[t, off:off+n] (+)= x[t] @ B[idx[t]].T    (0 where idx[t] < 0)

`x` (tokens, in) fp32/bf16; `A` (slots, [1,] rank, in); `B` (slots, [1,] out, rank). Rows of one
slot are one matmul (`x[rows] @ W[s].T`); a batch that uses one slot is a single matmul. Small
batches (decode, <= `GATHER_MAX_ROWS` rows) keep the gather, which is cheaper than one matmul
per slot there, with the -1 rows zeroed.

Above those ops, `PunicaWrapperCPU.add_lora_linear` and `add_lora_logits` are replaced too
(the second half of this file): they work out a plan once per forward step instead of in each
op call. What serving runs is both; `benchmarks/bench_cpu_lora.py` compares them with vLLM's.
"""

from __future__ import annotations

import torch

GATHER_MAX_ROWS = 32


def _weights(w: torch.Tensor) -> torch.Tensor:
    return w.squeeze(1) if w.dim() == 4 else w  # (slots, out, in)


def _apply(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(rows, in) x (slots, out, in) by per-row slot -> (rows, out), zero rows for idx < 0."""
    w = _weights(w)
    x = x.to(w.dtype) if x.dtype != w.dtype else x
    idx = idx[: x.shape[0]] if idx.shape[0] > x.shape[0] else idx
    first = int(idx[0]) if idx.numel() else -1
    if idx.numel() and first >= 0 and bool((idx == first).all()):
        return x @ w[first].T
    negative = idx < 0
    if x.shape[0] <= GATHER_MAX_ROWS:
        out = torch.einsum("bi,boi->bo", x, w[idx.clamp(min=0)])
        if bool(negative.any()):
            out[negative] = 0
        return out
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for s in torch.unique(idx).tolist():
        if s >= 0:
            rows = (idx == s).nonzero(as_tuple=True)[0]
            out.index_copy_(0, rows, x.index_select(0, rows) @ w[s].T)
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _apply(inputs, lora_b_weights, lora_indices_tensor).to(output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _apply(inputs.to(output_tensor.dtype), lora_b_weights, lora_indices_tensor).to(output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = _apply(inputs.to(output_tensor.dtype), lora_b_weights, lora_indices_tensor).to(output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    idx = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, idx, scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    idx = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, idx, add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    idx = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, idx, slice_offset, slice_size, add_inputs)


# --- one plan per forward step, for PunicaWrapperCPU.add_lora_linear / add_lora_logits ---------
#
# vLLM calls add_lora_linear once per LoRA layer (7 a decoder layer: 210 a step for SmolLM2), and
# each call runs the ops above once per output slice, each finding out again which slot every
# row uses (a unique or an all-equal test, which waits on the tensor). The plan works that out
# once per step, when the step's row -> slot indices change, and each call then costs a few
# matmuls per slice:
#   one slot, no base rows:  h = x @ A[s].T;  y_slice += scale * h @ B[s].T
#   few rows (decode):       h = (x @ A_cat.T) * mask;  y_slice += scale * h_slice @ B_all
#                            (A_all, B_all: every slot's A and B side by side, (slots*r, in) and
#                            (slots*r, out); A_cat: the slices' A_all stacked, so the slices of a
#                            merged layer (q, k, v; gate, up) share one shrink; mask keeps each
#                            row's own slot, zero for base rows)
#   many rows (prefill):     per slot, the rows of that slot, as the grouped ops do
# The dense form spends slots x the LoRA FLOPs to avoid gathers and per-slot loops: worth it
# while rows are few (DENSE_MAX_ROWS); prefill-sized batches take the grouped form.
#
# r is the rank the loaded adapters use: vLLM pads every adapter to --max-lora-rank with zeros
# (16 by default, where clora's learner trains rank 8), and the zero half is skipped. A_all,
# B_all and r are worked out once per version of the weights: vLLM writes a new adapter into a
# slot in place, which bumps the tensor's write count (`_version`).

DENSE_MAX_ROWS = 64


class _Plan:
    """Which slot each row of one forward step uses. `key` is the indices tensor's identity and
    write count: vLLM rewrites those indices in place, which bumps the count."""

    def __init__(self, key: tuple, idx: torch.Tensor):
        self.key, self.rows = key, idx.shape[0]
        used = torch.unique(idx).tolist()
        self.has_base = bool(used) and used[0] < 0
        self.slots = [s for s in used if s >= 0]
        self.idx = idx.clone()
        self._groups: dict[int, torch.Tensor] | None = None
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def groups(self) -> dict[int, torch.Tensor]:
        if self._groups is None:
            self._groups = {s: (self.idx == s).nonzero(as_tuple=True)[0] for s in self.slots}
        return self._groups

    def mask(self, slots: int, ranks: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """(rows, slots*sum(ranks)): for each slice in turn, 1 on the row's own slot's block of
        that slice's rank, 0 elsewhere and on base rows."""
        m = self._masks.get((slots, ranks, dtype))
        if m is None:
            own = (self.idx.unsqueeze(1) == torch.arange(slots).unsqueeze(0)).to(dtype)
            m = self._masks[(slots, ranks, dtype)] = torch.cat([own.repeat_interleave(r, dim=1) for r in ranks], 1)
        return m


def _per_version(cache: dict, tensors: tuple[torch.Tensor, ...], build):
    """`build()`, redone only after vLLM writes into one of `tensors` (a new adapter in a slot, a
    slot reset: in place, which bumps the tensor's write count)."""
    where, version = tuple(t.data_ptr() for t in tensors), tuple(t._version for t in tensors)
    hit = cache.get(where)
    if hit is None or hit[0] != version:
        hit = cache[where] = (version, build())
    return hit[1]


class _Packed:
    """One LoRA slice's stacked weights, A (slots, 1, R, in) and B (slots, 1, out, R), as the
    plan uses them: the used rank r, and A_all / B_all for the dense form."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        slots, rank, out = a.shape[0], a.shape[-2], b.shape[-2]
        self.a = a.view(slots, rank, a.shape[-1])
        self.b = b.view(slots, out, rank)
        used = (self.a.abs().amax(dim=(0, 2)) > 0).nonzero()
        self.rank = int(used.max()) + 1 if used.numel() else 0
        r = self.rank
        self.a_all = self.a[:, :r].reshape(slots * r, -1)
        self.b_all = self.b[:, :, :r].permute(0, 2, 1).reshape(slots * r, out)


class _PackedLayer:
    """A LoRA layer's slices packed together (`_Packed` each): the slices with a used rank, and
    their A_all stacked into A_cat (sum of slots*r, in), so one matmul is every slice's shrink."""

    def __init__(self, a_stacked, b_stacked, sizes):
        self.slices, offset = [], 0
        for a, b, n in zip(a_stacked, b_stacked, sizes):
            w = _Packed(a, b)
            if w.rank:
                self.slices.append((w, offset, n))
            offset += n
        self.ranks = tuple(w.rank for w, _, _ in self.slices)
        self.a_cat = torch.cat([w.a_all for w, _, _ in self.slices]) if self.slices else None
        self.dtype = a_stacked[0].dtype


def _layer(a_stacked: tuple, b_stacked: tuple, sizes) -> _PackedLayer | None:
    """The layer's `_PackedLayer`, built once per version of its weights (`_per_version`); None
    when the layout is not the one the plan handles."""
    def build() -> _PackedLayer | None:
        usable = all(a.dtype == b.dtype == a_stacked[0].dtype and b.shape[-2] == n and a.is_contiguous()
                     and b.is_contiguous() for a, b, n in zip(a_stacked, b_stacked, sizes))
        return _PackedLayer(a_stacked, b_stacked, sizes) if usable else None

    return _per_version(_LAYERS, (*a_stacked, *b_stacked), build)


_LAYERS: dict = {}     # a layer's (A..., B...) -> its _PackedLayer, or None (`_layer`)
_ZERO_LOGITS: dict = {}  # lm_head LoRA B -> whether it is all zero


def _plan(wrapper) -> _Plan:
    indices = wrapper._token_lora_indices
    key = (indices.data_ptr(), indices._version, wrapper.indices_len[0])
    plan = getattr(wrapper, "_clora_plan", None)
    if plan is None or plan.key != key:
        plan = wrapper._clora_plan = _Plan(key, wrapper.token_lora_indices)
    return plan


def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                    add_inputs=True, **kwargs):
    """`PunicaWrapperCPU.add_lora_linear` with one plan per step: for each slice i,
    y[:, off_i:off_i+n_i] += scale * (x @ A_i[idx].T) @ B_i[idx].T, nothing for base rows."""
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    plan = _plan(self)
    if add_inputs and plan.rows == x2.shape[0] == y2.shape[0] and x2.dtype == y2.dtype:
        if not plan.slots:
            return None  # base rows only: nothing to add
        layer = _layer(lora_a_stacked, lora_b_stacked, output_slices)
    else:
        layer = None
    if layer is None or layer.dtype != x2.dtype:
        return _ORIGINAL["add_lora_linear"](self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                            buffer=buffer, add_inputs=add_inputs, **kwargs)
    if not layer.slices:
        return None
    if len(plan.slots) == 1 and not plan.has_base:
        s = plan.slots[0]
        for w, offset, n in layer.slices:
            r = w.rank
            y2[:, offset: offset + n].addmm_(x2 @ w.a[s, :r].T, w.b[s, :, :r].T, alpha=scale)
    elif plan.rows <= DENSE_MAX_ROWS:
        h = (x2 @ layer.a_cat.T).mul_(plan.mask(lora_a_stacked[0].shape[0], layer.ranks, x2.dtype))
        col = 0
        for w, offset, n in layer.slices:
            width = w.a_all.shape[0]
            y2[:, offset: offset + n].addmm_(h[:, col: col + width], w.b_all, alpha=scale)
            col += width
    else:
        for w, offset, n in layer.slices:
            r, out = w.rank, y2[:, offset: offset + n]
            for s, rows in plan.groups().items():
                h = x2.index_select(0, rows) @ w.a[s, :r].T
                out.index_add_(0, rows, h @ w.b[s, :, :r].T, alpha=scale)
    return None


def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
    """`PunicaWrapperCPU.add_lora_logits`, skipped while no loaded adapter has an lm_head LoRA.
    vLLM runs it on every step with LoRA on; its B is (slots, 1, vocab, rank), which the ops
    gather per row (tens of MB a step for SmolLM2's 49k vocabulary) to add zeros."""
    if _per_version(_ZERO_LOGITS, (lora_b_stacked,), lambda: not bool(lora_b_stacked.any())):
        return None
    return _ORIGINAL["add_lora_logits"](self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


PLAN_METHODS = ("add_lora_linear", "add_lora_logits")
"""The `PunicaWrapperCPU` methods `install` replaces with the functions of the same name above."""
_ORIGINAL: dict[str, object] = {}  # PunicaWrapperCPU's own methods, for the cases above that defer


OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def install() -> list[str]:
    """Replace the ops in every vLLM module that bound them. Returns the patched module names."""
    import sys

    patched = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("vllm.lora"):
            continue
        hit = False
        for op in OPS:
            if hasattr(mod, op):
                setattr(mod, op, globals()[op])
                hit = True
        if hit:
            patched.append(name)
    wrapper = sys.modules.get("vllm.lora.punica_wrapper.punica_cpu")
    for method in PLAN_METHODS:
        cls = getattr(wrapper, "PunicaWrapperCPU", None)
        if cls is not None and getattr(cls, method).__module__ != __name__:
            _ORIGINAL[method] = getattr(cls, method)
            setattr(cls, method, globals()[method])
            patched.append(f"{wrapper.__name__}.PunicaWrapperCPU.{method}")
    return patched

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
    return patched

"""Fused LoRA delta for serving: shrink and expand in one launch, rows gathered and scattered in
the kernel, added in place into the base projection's output.

Semantics (batch order, no sorting by the caller):

    for every token t with an adapter a = adapter(t):
        y[t] += (x[t] @ A[a]) @ B[a] * scale[a]
    tokens without an adapter (after `seg_starts[-1]` in sorted order) are left untouched

    x:     (tokens, k)             fp32 | fp16 | bf16, batch order
    A:     (num_adapters, k, r)    same dtype; r small (a merged projection's slices side by side)
    B:     (num_adapters, r, n)    same dtype; any strides
    scale: (num_adapters,) fp32
    y:     (tokens, n)             dtype of x, written in place (a column slice is fine)

Why. The per-op path (`lora_shrink` then `lora_expand`, plus a gather into adapter order and an
`index_add_` back) is 3-5 launches per projection, each a few microseconds even inside a CUDA
graph. In a graphed decode step of SmolLM2's shape on an H200 (`benchmarks/bench_decode.py`),
those launches, not the arithmetic, held 8 mixed adapters to 0.25-0.47x of the base model's
tokens/s. Here each program takes one block of one adapter's rows and one block of output
columns, recomputes that block's `x @ A` (a (rows, r) product over k, cheap at LoRA ranks) and
adds its share of `h @ B`: one launch per projection, nothing to zero, and the rows read and
written through `token_order`, so unsorted batches need no copies either. Every (row, column)
of y is written by exactly one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segmented_mm import _block
from .segments import SegmentMeta


def fused_lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                         meta: SegmentMeta) -> torch.Tensor:
    """Pure-torch twin of the kernel (see the module's Semantics); fp32 accumulation. Returns y."""
    acc = torch.promote_types(x.dtype, torch.float32)
    for i in range(meta.num_adapters):
        s, e = meta.starts[i], meta.starts[i + 1]
        if s == e:
            continue
        rows = meta.token_order[s:e]
        part = (x[rows].to(acc) @ a[i].to(acc)) @ b[i].to(acc) * scale[i].to(acc)
        y[rows] = (y[rows].to(acc) + part).to(y.dtype)
    return y


@triton.jit
def _fused_lora_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, scale_ptr, seg_starts_ptr, order_ptr,
    K, R, N,
    stride_xt, stride_xk,
    stride_aa, stride_ak, stride_ar,
    stride_ba, stride_br, stride_bn,
    stride_yt, stride_yn,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # grid: (num_adapters, cdiv(max_seg_len, BLOCK_M), cdiv(N, BLOCK_N))
    slot = tl.program_id(0)
    seg_start = tl.load(seg_starts_ptr + slot)
    seg_end = tl.load(seg_starts_ptr + slot + 1)
    row0 = seg_start + tl.program_id(1) * BLOCK_M
    if row0 >= seg_end:
        return
    sorted_rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = sorted_rows < seg_end
    tokens = tl.load(order_ptr + sorted_rows, mask=row_ok, other=0).to(tl.int64)  # batch rows
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # B's tile and y's are loaded before the shrink's loop needs the memory system: their latency
    # overlaps it (a launch here is a few microseconds, mostly waiting on dependent loads)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_ba + rs[:, None] * stride_br + cols[None, :] * stride_bn,
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_N)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_aa
    h = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        a = tl.load(a_base + ks[:, None] * stride_ak + rs[None, :] * stride_ar,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_R)
        if DOT_FP32:
            h += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            h += tl.dot(x, a)
    h *= tl.load(scale_ptr + slot).to(tl.float32)
    if DOT_FP32:
        delta = tl.dot(h, b.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(h.to(b.dtype), b)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def fused_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                      meta: SegmentMeta, *, kernel=_fused_lora_kernel, dot_fp32: bool = False) -> torch.Tensor:
    """The kernel (see the module's Semantics). Returns y. `kernel` is this module's kernel or
    its interpreted twin (chosen by the backend); `dot_fp32` casts tiles to fp32 for `tl.dot`
    (needed by the interpreter for bf16)."""
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or y.dim() != 2:
        raise ValueError("expected x (tokens, k), A (adapters, k, r), B (adapters, r, n), y (tokens, n)")
    if a.shape[0] != meta.num_adapters or b.shape[0] != meta.num_adapters or a.shape[1] != x.shape[1] \
            or a.shape[2] != b.shape[1] or y.shape != (x.shape[0], b.shape[2]) or x.shape[0] != meta.num_tokens:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}, "
                         f"y {tuple(y.shape)}, {meta.num_adapters} slots, {meta.num_tokens} tokens")
    if meta.max_seg_len == 0:
        return y
    k, r, n = x.shape[1], a.shape[2], b.shape[2]
    block_m = _block(meta.max_seg_len, 16, 64)
    block_n = _block(n, 16, 64)
    block_k = _block(k, 16, 256)     # fewer dependent steps in the shrink's loop
    grid = (meta.num_adapters, triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(n, block_n))
    kernel[grid](
        x, a, b, y, scale, meta.seg_starts, meta.token_order,
        k, r, n,
        x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        y.stride(0), y.stride(1),
        DOT_FP32=dot_fp32 or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=_block(r, 16, 128),
    )
    return y

"""Segmented matmul: each adapter's segment of sorted token rows times that adapter's matrix.

This one op is the LoRA shrink (`w` = A), the expand (`w` = B, accumulating), and in the
backward pass the input gradients (`w` = B^T, then A^T, both as strided views). The
module holds the Triton kernel and its pure-torch reference; the reference is the CPU path.

Semantics:
    for i in range(num_adapters):
        s, e = seg_starts[i], seg_starts[i + 1]
        out[s:e] (+)= (x[s:e] @ w[i]) * scale[i]      # fp32 accumulation (fp64 for fp64)
    rows outside every segment (base-only tokens) are left untouched (or zero in a new out)

    x:     (tokens, k)            fp32 | fp16 | bf16 (fp64 in the reference only), rows sorted by adapter slot
    w:     (num_adapters, k, n)   same dtype as x; any strides (transposed views welcome)
    scale: (num_adapters,) fp32 or None (all ones)
    out:   (tokens, n)            dtype of x; written in place when given
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import SegmentMeta


def _check(x: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected x (tokens, k) and w (adapters, k, n); got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[0] != meta.num_tokens:
        raise ValueError(f"x has {x.shape[0]} token rows but the SegmentMeta describes {meta.num_tokens}")
    if w.shape[0] != meta.num_adapters or w.shape[1] != x.shape[1]:
        raise ValueError(
            f"w {tuple(w.shape)} does not match x {tuple(x.shape)} with {meta.num_adapters} adapter slots"
        )
    if scale is not None and scale.shape != (meta.num_adapters,):
        raise ValueError(f"scale must have shape ({meta.num_adapters},), got {tuple(scale.shape)}")


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    if out is None:
        return torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device), False
    if out.shape != (x.shape[0], n):
        raise ValueError(f"out must have shape {(x.shape[0], n)}, got {tuple(out.shape)}")
    return out, True


def segmented_mm_reference(
    x: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, scale: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch segmented matmul (see the module's Semantics). Returns `out`."""
    _check(x, w, meta, scale)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 accumulation; float64 stays float64
    if x.dtype == w.dtype == acc and (out is None or out.dtype == acc):
        return _segmented_mm_full_precision(x, w, meta, scale, out)
    out, _ = _output(x, w.shape[2], out)
    for i in range(meta.num_adapters):
        rows = meta.segment(i)
        if rows.start == rows.stop:
            continue
        part = x[rows].to(acc) @ w[i].to(acc)  # (seg_len, n)
        if scale is not None:
            part = part * scale[i].to(acc)
        out[rows] = (out[rows].to(acc) + part).to(out.dtype)  # add before rounding, like the kernel
    return out


def _segmented_mm_full_precision(
    x: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, scale: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """The reference when x, w and out are already the accumulation dtype (fp32, fp64): one
    BLAS call per segment writing (or adding) straight into `out`, `scale` as its alpha, so
    the CPU path makes one pass over its output rows, like the kernel, instead of four."""
    alphas = scale.tolist() if scale is not None else [1.0] * meta.num_adapters  # one host copy
    fresh = out is None
    if fresh:
        out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
        out[meta.num_lora_tokens:].zero_()  # base-only rows
    elif out.shape != (x.shape[0], w.shape[2]):
        raise ValueError(f"out must have shape {(x.shape[0], w.shape[2])}, got {tuple(out.shape)}")
    for i in range(meta.num_adapters):
        s, e = meta.starts[i], meta.starts[i + 1]
        if s == e:
            continue
        rows = out[s:e]
        # beta=0 ignores the (uninitialised) input rows entirely, NaNs included
        torch.addmm(rows, x[s:e], w[i], beta=0 if fresh else 1, alpha=alphas[i], out=rows)
    return out


@triton.jit
def _segmented_mm_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, seg_starts_ptr,
    K, N,
    stride_xt, stride_xk,
    stride_wa, stride_wk, stride_wn,
    stride_ot, stride_on,
    HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (num_adapters, cdiv(max_seg_len, BLOCK_M), cdiv(N, BLOCK_N))
    slot = tl.program_id(0)
    seg_start = tl.load(seg_starts_ptr + slot)
    seg_end = tl.load(seg_starts_ptr + slot + 1)
    row0 = seg_start + tl.program_id(1) * BLOCK_M
    if row0 >= seg_end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < seg_end
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # builtin, not the jit-defined tl.zeros
    w_base = w_ptr + slot.to(tl.int64) * stride_wa
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :] * stride_on
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block(size: int, lo: int, hi: int) -> int:
    """Power-of-two tile covering `size`, clamped to [lo, hi] (tl.dot tiles are >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(max(size, 1))))


def segmented_mm_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    meta: SegmentMeta,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    kernel=_segmented_mm_kernel,
    dot_fp32: bool = False,
) -> torch.Tensor:
    """Triton segmented matmul (see the module's Semantics). Returns `out`.

    `kernel` is this module's kernel or its interpreted twin (chosen by the backend);
    `dot_fp32` casts tiles to fp32 before `tl.dot` (needed by the interpreter for bf16).
    """
    _check(x, w, meta, scale)
    n = w.shape[2]
    out, accumulate = _output(x, n, out)
    if meta.max_seg_len == 0 or n == 0:
        return out
    k = x.shape[1]
    block_m = _block(meta.max_seg_len, 16, 64)
    block_n = _block(n, 16, 64)
    block_k = _block(k, 16, 64)
    grid = (meta.num_adapters, triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(n, block_n))
    kernel[grid](
        x, w, out, scale if scale is not None else x, meta.seg_starts,
        k, n,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        HAS_SCALE=scale is not None, ACCUMULATE=accumulate,
        DOT_FP32=dot_fp32 or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out

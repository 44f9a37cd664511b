"""Segmented weight gradient: per adapter, the outer-product sum over that adapter's tokens.

This is the LoRA backward for the adapter matrices: `dA[i] = x_i^T @ dv_i` and
`dB[i] = v_i^T @ dy_i * scale[i]`. The module holds the Triton kernel and its pure-torch
reference; the reference is the CPU path.

Semantics:
    for i in range(num_adapters):
        s, e = seg_starts[i], seg_starts[i + 1]
        dw[i] = (a[s:e]^T @ b[s:e]) * scale[i]      # fp32 (fp64 for fp64) accumulation; zeros if s == e

    a:     (tokens, p)   fp32 | fp16 | bf16, rows sorted by adapter slot
    b:     (tokens, q)   same dtype as a
    scale: (num_adapters,) fp32 or None (all ones)
    dw:    (num_adapters, p, q) in `out_dtype` (default: dtype of a)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import SegmentMeta


def _check(a: torch.Tensor, b: torch.Tensor, meta: SegmentMeta, scale: torch.Tensor | None) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"expected a (tokens, p) and b (tokens, q); got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] != meta.num_tokens:
        raise ValueError(f"a has {a.shape[0]} token rows but the SegmentMeta describes {meta.num_tokens}")
    if scale is not None and scale.shape != (meta.num_adapters,):
        raise ValueError(f"scale must have shape ({meta.num_adapters},), got {tuple(scale.shape)}")


def segmented_weight_grad_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    meta: SegmentMeta,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch segmented weight gradient (see the module's Semantics)."""
    _check(a, b, meta, scale)
    acc = torch.promote_types(a.dtype, torch.float32)  # fp32 accumulation; float64 stays float64
    dw = torch.zeros(meta.num_adapters, a.shape[1], b.shape[1], dtype=acc, device=a.device)
    if a.dtype == b.dtype == acc:  # fp32 / fp64: one BLAS call per segment, scale as its alpha
        alphas = scale.tolist() if scale is not None else [1.0] * meta.num_adapters
        for i in range(meta.num_adapters):
            s, e = meta.starts[i], meta.starts[i + 1]
            if s != e:
                torch.addmm(dw[i], a[s:e].T, b[s:e], beta=0, alpha=alphas[i], out=dw[i])
        return dw.to(out_dtype or a.dtype)
    for i in range(meta.num_adapters):
        rows = meta.segment(i)
        if rows.start == rows.stop:
            continue
        dw[i] = a[rows].to(acc).T @ b[rows].to(acc)  # (p, q)
        if scale is not None:
            dw[i] *= scale[i].to(acc)
    return dw.to(out_dtype or a.dtype)


@triton.jit
def _segmented_weight_grad_kernel(
    a_ptr, b_ptr, dw_ptr, scale_ptr, seg_starts_ptr,
    P, Q,
    stride_at, stride_ap,
    stride_bt, stride_bq,
    stride_wa, stride_wp, stride_wq,
    HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # grid: (num_adapters, cdiv(P, BLOCK_P), cdiv(Q, BLOCK_Q)); each program loops over its segment
    slot = tl.program_id(0)
    seg_start = tl.load(seg_starts_ptr + slot)
    seg_end = tl.load(seg_starts_ptr + slot + 1)
    ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    qs = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    p_ok = ps < P
    q_ok = qs < Q
    acc = tl.full((BLOCK_P, BLOCK_Q), 0.0, tl.float32)  # builtin, not the jit-defined tl.zeros
    for t0 in range(seg_start, seg_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < seg_end
        # a tile loaded transposed: (BLOCK_P, BLOCK_T)
        a_t = tl.load(a_ptr + ps[:, None] * stride_ap + ts[None, :].to(tl.int64) * stride_at,
                      mask=p_ok[:, None] & t_ok[None, :], other=0.0)
        b = tl.load(b_ptr + ts[:, None].to(tl.int64) * stride_bt + qs[None, :] * stride_bq,
                    mask=t_ok[:, None] & q_ok[None, :], other=0.0)  # (BLOCK_T, BLOCK_Q)
        if DOT_FP32:
            acc += tl.dot(a_t.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a_t, b)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + slot).to(tl.float32)
    dw_ptrs = dw_ptr + slot.to(tl.int64) * stride_wa + ps[:, None] * stride_wp + qs[None, :] * stride_wq
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def _block(size: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(size, 1))))


def segmented_weight_grad_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    meta: SegmentMeta,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    kernel=_segmented_weight_grad_kernel,
    dot_fp32: bool = False,
) -> torch.Tensor:
    """Triton segmented weight gradient (see the module's Semantics).

    `kernel` is this module's kernel or its interpreted twin (chosen by the backend);
    `dot_fp32` casts tiles to fp32 before `tl.dot` (needed by the interpreter for bf16).
    """
    _check(a, b, meta, scale)
    p, q = a.shape[1], b.shape[1]
    dw = torch.empty(meta.num_adapters, p, q, dtype=out_dtype or a.dtype, device=a.device)
    if p == 0 or q == 0:
        return dw
    block_p = _block(p, 16, 64)
    block_q = _block(q, 16, 64)
    block_t = _block(meta.max_seg_len, 16, 64)
    grid = (meta.num_adapters, triton.cdiv(p, block_p), triton.cdiv(q, block_q))
    kernel[grid](
        a, b, dw, scale if scale is not None else a, meta.seg_starts,
        p, q,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        HAS_SCALE=scale is not None, DOT_FP32=dot_fp32 or a.dtype == torch.float32,
        BLOCK_P=block_p, BLOCK_Q=block_q, BLOCK_T=block_t,
    )
    return dw

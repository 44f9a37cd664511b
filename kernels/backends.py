"""Backends for the two segmented primitives: pure torch (the CPU path) and Triton.

A backend is chosen when a layer or op object is built (`make_backend`), never at import
time. The Triton backend runs compiled kernels on CUDA, or the Triton interpreter on CPU
tensors (how the parity tests run it); it decides which when it is built, so it does not
depend on `TRITON_INTERPRET` having been set before this package was imported.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from . import fused_lora as _fused
from . import segmented_mm as _mm
from . import segmented_weight_grad as _wg
from .segments import SegmentMeta

BackendName = Literal["auto", "torch", "triton"]


@runtime_checkable
class SegmentedBackend(Protocol):
    """The two primitives every segmented LoRA op is built from (see their modules)."""

    name: str

    def segmented_mm(
        self,
        x: torch.Tensor,  # (tokens, k)
        w: torch.Tensor,  # (num_adapters, k, n)
        meta: SegmentMeta,
        scale: torch.Tensor | None = None,  # (num_adapters,)
        out: torch.Tensor | None = None,  # (tokens, n), accumulated into when given
    ) -> torch.Tensor: ...

    def segmented_weight_grad(
        self,
        a: torch.Tensor,  # (tokens, p)
        b: torch.Tensor,  # (tokens, q)
        meta: SegmentMeta,
        scale: torch.Tensor | None = None,  # (num_adapters,)
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # (num_adapters, p, q)

    def fused_lora(
        self,
        y: torch.Tensor,  # (tokens, n), batch order, added into in place
        x: torch.Tensor,  # (tokens, k), batch order
        a: torch.Tensor,  # (num_adapters, k, r)
        b: torch.Tensor,  # (num_adapters, r, n)
        scale: torch.Tensor,  # (num_adapters,)
        meta: SegmentMeta,
    ) -> torch.Tensor: ...  # y


class TorchBackend:
    """Pure-torch references; the CPU path."""

    name = "torch"

    def segmented_mm(self, x, w, meta, scale=None, out=None):
        return _mm.segmented_mm_reference(x, w, meta, scale, out)

    def segmented_weight_grad(self, a, b, meta, scale=None, out_dtype=None):
        return _wg.segmented_weight_grad_reference(a, b, meta, scale, out_dtype)

    def fused_lora(self, y, x, a, b, scale, meta):
        return _fused.fused_lora_reference(y, x, a, b, scale, meta)

    def __repr__(self) -> str:
        return "TorchBackend()"


class TritonBackend:
    """Triton kernels: compiled on CUDA, interpreted on CPU (`interpret=True`).

    `interpret=None` picks the interpreter exactly when no CUDA device is available.
    """

    name = "triton"

    def __init__(self, interpret: bool | None = None) -> None:
        self.interpret = (not torch.cuda.is_available()) if interpret is None else interpret
        self._mm_kernel = self._variant(_mm._segmented_mm_kernel)
        self._wg_kernel = self._variant(_wg._segmented_weight_grad_kernel)
        self._fused_kernel = self._variant(_fused._fused_lora_kernel)

    def _variant(self, kernel):
        from triton.runtime.interpreter import InterpretedFunction

        is_interpreted = isinstance(kernel, InterpretedFunction)
        if self.interpret and not is_interpreted:
            return InterpretedFunction(kernel.fn)
        if not self.interpret and is_interpreted:
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set when clora.kernels was imported, so its Triton kernels "
                "only run interpreted; build TritonBackend(interpret=True) or unset TRITON_INTERPRET"
            )
        return kernel

    def _check_device(self, t: torch.Tensor, meta: SegmentMeta) -> None:
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"Triton kernels take fp32, fp16 or bf16 tensors, got {t.dtype} (use TorchBackend)")
        if not self.interpret and t.device.type != "cuda":
            raise ValueError(f"compiled Triton kernels need CUDA tensors, got a tensor on {t.device}")
        if meta.seg_starts.device != t.device:
            raise ValueError(
                f"SegmentMeta lives on {meta.seg_starts.device} but the tokens on {t.device}; "
                "build it with device= the batch's device"
            )

    def segmented_mm(self, x, w, meta, scale=None, out=None):
        self._check_device(x, meta)
        return _mm.segmented_mm_triton(
            x, w, meta, scale, out, kernel=self._mm_kernel, dot_fp32=self.interpret
        )

    def segmented_weight_grad(self, a, b, meta, scale=None, out_dtype=None):
        self._check_device(a, meta)
        return _wg.segmented_weight_grad_triton(
            a, b, meta, scale, out_dtype, kernel=self._wg_kernel, dot_fp32=self.interpret
        )

    def fused_lora(self, y, x, a, b, scale, meta):
        self._check_device(x, meta)
        return _fused.fused_lora_triton(y, x, a, b, scale, meta, kernel=self._fused_kernel, dot_fp32=self.interpret)

    def __repr__(self) -> str:
        return f"TritonBackend(interpret={self.interpret})"


def make_backend(name: BackendName = "auto", device: torch.device | str | None = None) -> SegmentedBackend:
    """Build a backend. `auto`: Triton for CUDA devices, torch otherwise.

    `device` defaults to CUDA when available. Forcing `triton` on a CPU device gives the
    interpreter (slow; for tests).
    """
    if name == "torch":
        return TorchBackend()
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "triton":
        return TritonBackend(interpret=dev.type != "cuda")
    if name == "auto":
        return TritonBackend(interpret=False) if dev.type == "cuda" else TorchBackend()
    raise ValueError(f"unknown backend {name!r}; expected 'auto', 'torch' or 'triton'")

"""clora.kernels: segmented multi-LoRA matmuls (Triton kernels + pure-torch references).

Modules:
    segments               `SegmentMeta`: tokens sorted by adapter slot, one segment per slot
    segmented_mm           out[seg i] (+)= x[seg i] @ w[i] * scale[i]   (shrink, expand, dx)
    segmented_weight_grad  dw[i] = a[seg i]^T @ b[seg i] * scale[i]      (dA, dB)
    fused_lora             y[t] += x[t] @ A[a(t)] @ B[a(t)] * scale[a(t)], one launch (serving)
    backends               `SegmentedBackend` protocol; `TorchBackend`, `TritonBackend`, `make_backend`
    lora_ops               `lora_shrink`, `lora_expand`, `lora_backward`
    autograd               `SegmentedLoRAFunction`, `segmented_lora`
    multi_lora_linear      `multi_lora_linear`, `MultiLoRALinear`

This package imports nothing else of clora's.
"""

from .autograd import SegmentedLoRAFunction, segmented_lora
from .backends import BackendName, SegmentedBackend, TorchBackend, TritonBackend, make_backend
from .lora_ops import LoRAGrads, lora_backward, lora_expand, lora_shrink
from .multi_lora_linear import MultiLoRALinear, multi_lora_linear
from .segments import BASE_ONLY, SegmentMeta

__all__ = [
    "BASE_ONLY",
    "BackendName",
    "LoRAGrads",
    "MultiLoRALinear",
    "SegmentMeta",
    "SegmentedBackend",
    "SegmentedLoRAFunction",
    "TorchBackend",
    "TritonBackend",
    "lora_backward",
    "lora_expand",
    "lora_shrink",
    "make_backend",
    "multi_lora_linear",
    "segmented_lora",
]

"""Compiled Triton kernels on CUDA at SmolLM2-135M shapes; skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_cases import PATTERNS, adapter_ids, stacked_adapters

from clora.kernels import SegmentMeta, TorchBackend, TritonBackend, make_backend, segmented_lora

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for compiled Triton kernels"),
]

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("hidden", [(576, 192), (576, 1536), (1536, 576)], ids=["k_proj", "up_proj", "down_proj"])
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
def test_compiled_kernels_match_reference(dtype, hidden, pattern):
    backend = make_backend("auto", "cuda")
    assert isinstance(backend, TritonBackend) and not backend.interpret
    ids = adapter_ids(pattern, 512, 8, seed=11)
    a, b, scale = stacked_adapters([8, 16, 8, 16, 4, 16, 8, 16], *hidden, dtype)
    x = torch.randn(512, hidden[0]).to(dtype)
    grad_y = torch.randn(512, hidden[1]).to(dtype)
    results = []
    for device, be, cast in (("cuda", backend, dtype), ("cpu", TorchBackend(), torch.float32)):
        meta = SegmentMeta.from_token_adapter_ids(ids, 8, device=device)
        xs = meta.to_sorted(x.to(device, cast)).requires_grad_()  # (tokens, hidden_in), sorted
        a_, b_ = a.to(device, cast).requires_grad_(), b.to(device, cast).requires_grad_()
        y = segmented_lora(xs, a_, b_, scale.to(device), meta, be)
        y.backward(meta.to_sorted(grad_y.to(device, cast)))
        results.append([t.detach().float().cpu() for t in (y, xs.grad, a_.grad, b_.grad)])
    for name, got, ref in zip(("y", "dx", "dA", "dB"), *results):
        tol = TOL[dtype]
        torch.testing.assert_close(
            got, ref, atol=tol * max(ref.abs().max().item(), 1e-3), rtol=tol, msg=lambda m: f"{name}: {m}"
        )

"""Triton kernels vs the pure-torch reference: forward and every gradient.

Matrix (Punica's): dtype x rank x hidden size x adapter popularity. The kernel runs in the
test dtype; the reference runs in fp32 on the same (upcast) inputs; tolerances are per
dtype, relative to the reference's largest magnitude. On CPU the kernels run in the
Triton interpreter, so shapes stay small; model-sized shapes are marked slow.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.kernels.kernel_cases import PATTERNS, sorted_meta, stacked_adapters

from clora.kernels import SegmentMeta, TorchBackend, TritonBackend, segmented_lora
from clora.kernels.segmented_mm import segmented_mm_reference, segmented_mm_triton
from clora.kernels.segmented_weight_grad import segmented_weight_grad_reference, segmented_weight_grad_triton

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = list(TOL)
RANKS = {"r8": [8, 8, 8, 8], "r16": [16, 16, 16, 16], "mixed": [4, 16, 8, 12]}
# (hidden_in, hidden_out, patterns): every pattern at the small size; 96 is not a tile multiple
HIDDEN_PATTERNS = [((64, 64), PATTERNS), ((128, 96), ("zipf", "empty_segments"))]
CASES = [(hidden, pattern) for hidden, patterns in HIDDEN_PATTERNS for pattern in patterns]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOL[dtype]
    magnitude = expected.abs().max().item()
    torch.testing.assert_close(
        actual.float(), expected, atol=tol * max(magnitude, 1e-3), rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def run_lora(x, a, b, scale, meta, backend, grad_y):
    x, a, b = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y = segmented_lora(x, a, b, scale, meta, backend)
    y.backward(grad_y)
    return y.detach(), x.grad, a.grad, b.grad


def check_parity(backend, dtype, ranks, hidden_in, hidden_out, pattern, tokens, seed=0):
    meta = sorted_meta(pattern, tokens, len(ranks), seed=seed)
    a, b, scale = stacked_adapters(ranks, hidden_in, hidden_out, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(tokens, hidden_in, generator=g).to(dtype)
    grad_y = torch.randn(tokens, hidden_out, generator=g).to(dtype)

    got = run_lora(x, a, b, scale, meta, backend, grad_y)
    ref = run_lora(*(t.float() for t in (x, a, b)), scale, meta, TorchBackend(), grad_y.float())
    for name, g_, r_ in zip(("y", "dx", "dA", "dB"), got, ref):
        assert g_.dtype == dtype, f"{name} has dtype {g_.dtype}, expected {dtype}"
        assert_matches(g_, r_, dtype, f"{name} ({pattern}, ranks {ranks}, {dtype})")

    y, dx, da, db = got
    base_rows = slice(meta.num_lora_tokens, tokens)
    assert torch.all(y[base_rows] == 0) and torch.all(dx[base_rows] == 0), "base-only rows got LoRA"
    for slot, rank in enumerate(ranks):
        assert torch.all(da[slot, :, rank:] == 0) and torch.all(db[slot, rank:] == 0), "padding got gradient"
        if meta.starts[slot] == meta.starts[slot + 1]:
            assert torch.all(da[slot] == 0) and torch.all(db[slot] == 0), f"empty slot {slot} got gradient"


@pytest.mark.parametrize(("hidden", "pattern"), CASES, ids=[f"{h[0]}x{h[1]}-{p}" for h, p in CASES])
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_matches_reference_forward_and_grads(triton_backend, dtype, ranks, hidden, pattern):
    check_parity(triton_backend, dtype, ranks, *hidden, pattern, tokens=40)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("hidden", [(576, 192), (576, 1536), (1536, 576)], ids=["k_proj", "up_proj", "down_proj"])
def test_triton_matches_reference_at_smollm_shapes(triton_backend, dtype, hidden):
    check_parity(triton_backend, dtype, [8, 16, 16, 8], *hidden, "zipf", tokens=64, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_segmented_mm_accumulates_into_out_with_transposed_weights(triton_backend, dtype):
    """Expand (`out +=`) and the backward's strided `B^T` views, kernel vs reference."""
    meta = sorted_meta("uniform", 33, 3, seed=5)
    w = torch.randn(3, 24, 40).to(dtype).transpose(1, 2)  # (3, 40, 24), non-contiguous
    x = torch.randn(33, 40).to(dtype)
    out0 = torch.randn(33, 24).to(dtype)
    scale = torch.tensor([0.5, 2.0, -1.0])
    got = segmented_mm_triton(x, w, meta, scale, out0.clone(), kernel=triton_backend._mm_kernel,
                              dot_fp32=triton_backend.interpret)
    ref = segmented_mm_reference(x.float(), w.float(), meta, scale, out0.float())
    assert_matches(got, ref, dtype, "segmented_mm accumulate")
    base_rows = slice(meta.num_lora_tokens, 33)
    assert torch.equal(got[base_rows], out0[base_rows]), "base-only rows of out were modified"


def test_weight_grad_writes_zeros_for_empty_segments(triton_backend):
    """The kernel allocates with torch.empty; empty segments must still come back as 0."""
    meta = SegmentMeta.from_token_adapter_ids([1, 1, 3, -1, 1], 4)
    a, b = torch.randn(5, 20), torch.randn(5, 17)
    got = segmented_weight_grad_triton(a, b, meta, kernel=triton_backend._wg_kernel, dot_fp32=True)
    torch.testing.assert_close(got, segmented_weight_grad_reference(a, b, meta))
    assert torch.all(got[0] == 0) and torch.all(got[2] == 0)


def test_triton_backend_rejects_cpu_tensors_when_compiled():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where compiled kernels cannot take CPU tensors")
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            TritonBackend(interpret=False)
    else:
        backend = TritonBackend(interpret=False)
        meta = SegmentMeta.from_token_adapter_ids([0], 1)
        with pytest.raises(ValueError, match="need CUDA tensors"):
            backend.segmented_mm(torch.zeros(1, 16), torch.zeros(1, 16, 16), meta)


def test_triton_backend_rejects_float64(triton_backend):
    meta = SegmentMeta.from_token_adapter_ids([0], 1)
    f64 = dict(dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32, fp16 or bf16 tensors, got torch.float64"):
        triton_backend.segmented_mm(torch.zeros(1, 16, **f64), torch.zeros(1, 16, 16, **f64), meta)

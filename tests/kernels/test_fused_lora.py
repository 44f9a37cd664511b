"""The fused serving kernel (`clora.kernels.fused_lora`): one launch adds each row's own adapter's
delta into y, in batch order, against a row-by-row fp32 reference. On CPU the kernel runs in
the Triton interpreter; the same cases run compiled under `-m gpu`."""

from __future__ import annotations

import pytest
import torch

from clora.kernels import BASE_ONLY, SegmentMeta, TorchBackend, TritonBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
SLOTS = 8
IDS = {
    "mixed": [3, 0, 7, 3, 1, 0, 5, 3],                    # unsorted; slots 2, 4, 6 unused
    "one adapter": [2] * 20,                              # more rows than a 16-row block
    "base rows": [1, BASE_ONLY, 1, 4, BASE_ONLY, 4, 4],   # rows without an adapter stay as they are
    "sorted": sorted([3, 0, 7, 3, 1, 0, 5, 3]),
}


def row_by_row(y, x, a, b, scale, ids):
    want = y.float().clone()
    for t, s in enumerate(ids):
        if s != BASE_ONLY:
            want[t] += (x[t].float() @ a[s].float()) @ b[s].float() * scale[s]
    return want


def case(ids: list[int], dtype, device="cpu", k=40, r=24, n=70):
    gen = torch.Generator().manual_seed(len(ids))
    x = torch.randn(len(ids), k, generator=gen).to(dtype)
    a = (torch.randn(SLOTS, k, r, generator=gen) * k**-0.5).to(dtype)
    b = (torch.randn(SLOTS, r, n, generator=gen) * 0.1).to(dtype)
    scale = torch.rand(SLOTS, generator=gen) + 0.5
    y = torch.randn(len(ids), n, generator=gen).to(dtype)
    meta = SegmentMeta.from_token_adapter_ids(torch.tensor(ids), SLOTS, device)
    return [t.to(device) for t in (y, x, a, b, scale)] + [meta]


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(IDS))
@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend(interpret=True)], ids=["torch", "triton"])
def test_each_row_gets_its_own_adapters_delta_added_in_place(backend, name, dtype):
    ids = IDS[name]
    y, x, a, b, scale, meta = case(ids, dtype)
    want = row_by_row(y, x, a, b, scale, ids)
    got = backend.fused_lora(y, x, a, b, scale, meta)
    assert got is y                                                   # in place
    tol = TOL[dtype] * max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=TOL[dtype])
    base = [t for t, s in enumerate(ids) if s == BASE_ONLY]
    if base:
        y0 = case(ids, dtype)[0]
        assert torch.equal(y[base], y0[base])


def test_a_column_slice_of_a_merged_output_is_written_and_nothing_beside_it():
    ids = IDS["mixed"]
    y, x, a, b, scale, meta = case(ids, torch.float32)
    wide = torch.zeros(len(ids), 100)
    wide[:, 10:80] = y
    TritonBackend(interpret=True).fused_lora(wide[:, 10:80], x, a, b, scale, meta)
    torch.testing.assert_close(wide[:, 10:80], row_by_row(y, x, a, b, scale, ids), atol=1e-5, rtol=1e-5)
    assert not wide[:, :10].any() and not wide[:, 80:].any()


def test_mismatched_shapes_are_refused_naming_them():
    y, x, a, b, scale, meta = case(IDS["mixed"], torch.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        TritonBackend(interpret=True).fused_lora(y[:, :5], x, a, b, scale, meta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for the compiled kernel")
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(IDS))
def test_the_compiled_kernel_matches_the_reference(name, dtype):
    ids = IDS[name]
    y, x, a, b, scale, meta = case(ids, dtype, device="cuda", k=576, r=24, n=960)
    want = row_by_row(y, x, a, b, scale, ids)
    TritonBackend(interpret=False).fused_lora(y, x, a, b, scale, meta)
    torch.testing.assert_close(y.float(), want, atol=TOL[dtype] * max(want.abs().max().item(), 1.0), rtol=TOL[dtype])

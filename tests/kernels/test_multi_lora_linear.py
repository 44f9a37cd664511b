"""MultiLoRALinear vs a per-adapter loop of plain `x @ W.T + (x @ A @ B) * scale`.

Also PEFT's mixed-batch invariant (a batch mixing tenants and base-only rows equals each
tenant run alone), the frozen base, rank padding and backend choice at build time.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_cases import PATTERNS, adapter_ids, assert_within_rounding
from torch import nn

from clora.kernels import MultiLoRALinear, SegmentMeta, TorchBackend, TritonBackend

IN, OUT, RANKS = 48, 40, (4, 8, 2)


def make_layer(backend, dtype=torch.float32, seed=0) -> tuple[MultiLoRALinear, list[tuple]]:
    torch.manual_seed(seed)
    base = nn.Linear(IN, OUT, bias=True).to(dtype)
    layer = MultiLoRALinear(base, num_adapters=len(RANKS), max_rank=8, backend=backend)
    adapters = []
    for slot, rank in enumerate(RANKS):
        a, b = torch.randn(IN, rank).to(dtype) / IN**0.5, torch.randn(rank, OUT).to(dtype)
        scale = 16.0 / rank
        layer.set_adapter(slot, a, b, scale)
        adapters.append((a, b, scale))
    return layer, adapters


def loop_reference(x, ids, weight, bias, adapters):
    """The obvious implementation: base for everyone, then each adapter over its own rows."""
    y = x @ weight.T + bias  # (tokens, out)
    for slot, (a, b, scale) in enumerate(adapters):
        rows = ids == slot
        y[rows] = y[rows] + (x[rows] @ a @ b) * scale
    return y


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_layer_matches_per_adapter_loop_forward_and_grads(backend_name, pattern, triton_backend):
    backend = triton_backend if backend_name == "triton" else TorchBackend()
    layer, adapters = make_layer(backend)
    ids = adapter_ids(pattern, 30, len(RANKS), seed=4)
    meta = SegmentMeta.from_token_adapter_ids(ids, len(RANKS))
    x = torch.randn(2, 15, IN, requires_grad=True)  # (batch, seq, in): tokens in batch order
    grad_y = torch.randn(2, 15, OUT)
    y = layer(x, meta)
    y.backward(grad_y)

    # The loop reference in fp64 gives the exact values; run on absolute values it gives, for
    # every output and gradient element, the sum of |terms| its rounding error scales with.
    def reference(absolute: bool):
        f = (lambda t: t.detach().double().abs()) if absolute else (lambda t: t.detach().double())
        x_ref = f(x).reshape(30, IN).requires_grad_()
        refs = [(f(a).requires_grad_(), f(b).requires_grad_(), s) for a, b, s in adapters]
        y_ref = loop_reference(x_ref, ids, f(layer.base.weight), f(layer.base.bias), refs)
        y_ref.backward(f(grad_y).reshape(30, OUT))
        return y_ref.detach(), x_ref.grad, refs

    (y_exact, dx_exact, exact), (y_mag, dx_mag, mag) = reference(False), reference(True)
    depth = IN + OUT + 30 + max(RANKS)  # the longest chain of products and sums behind any element
    assert_within_rounding(y.reshape(30, OUT), y_exact, y_mag, depth, "y")
    assert_within_rounding(x.grad.reshape(30, IN), dx_exact, dx_mag, depth, "dx")
    for slot, ((a, b, _), (a_mag, b_mag, _)) in enumerate(zip(exact, mag)):
        rank = RANKS[slot]
        if a.grad is None:  # the slot had no tokens: its gradient is exactly zero
            assert torch.all(layer.lora_a.grad[slot] == 0) and torch.all(layer.lora_b.grad[slot] == 0)
            continue
        assert_within_rounding(layer.lora_a.grad[slot, :, :rank], a.grad, a_mag.grad, depth, f"dA[{slot}]")
        assert_within_rounding(layer.lora_b.grad[slot, :rank], b.grad, b_mag.grad, depth, f"dB[{slot}]")
        assert torch.all(layer.lora_a.grad[slot, :, rank:] == 0) and torch.all(layer.lora_b.grad[slot, rank:] == 0)
    assert layer.base.weight.grad is None and layer.base.bias.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixed_batch_equals_each_tenant_alone(dtype):
    """PEFT's TestMixedAdapterBatches: mixing tenants and base-only rows changes nobody's output."""
    layer, _ = make_layer("torch", dtype)
    ids = torch.tensor([2, -1, 0, 2, 1, 0, -1, 1, 2, 0])
    x = torch.randn(10, IN).to(dtype)
    # BLAS blocking depends on the row count, so equality is up to rounding, not bitwise.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    mixed = layer(x, SegmentMeta.from_token_adapter_ids(ids, 3))
    for slot in (-1, 0, 1, 2):
        rows = ids == slot
        alone = layer(x[rows], SegmentMeta.from_token_adapter_ids(ids[rows], 3))
        torch.testing.assert_close(mixed[rows], alone, **tol, msg=lambda m: f"slot {slot} batched vs alone: {m}")
    base_rows = ids == -1
    torch.testing.assert_close(mixed[base_rows], layer.base(x[base_rows]), **tol)
    lora_gap = (mixed[ids == 0] - layer.base(x[ids == 0])).abs().max().item()
    assert lora_gap > 0.1, "the adapter made no difference to its tenant's rows"


def test_cleared_slot_gives_base_output_and_adapter_views_round_trip():
    layer, adapters = make_layer("torch")
    a1, b1 = layer.adapter(1)
    assert torch.equal(a1, adapters[1][0]) and torch.equal(b1, adapters[1][1])
    layer.clear_adapter(1)
    x = torch.randn(5, IN)
    y = layer(x, SegmentMeta.from_token_adapter_ids([1] * 5, 3))
    torch.testing.assert_close(y, layer.base(x))
    assert layer.adapter(1)[0].shape == (IN, 0)


def test_backend_is_chosen_when_the_layer_is_built():
    auto = MultiLoRALinear(nn.Linear(IN, OUT), 2, 4)
    assert isinstance(auto.backend, TorchBackend if not torch.cuda.is_available() else TritonBackend)
    forced = MultiLoRALinear(nn.Linear(IN, OUT), 2, 4, backend="triton")
    assert isinstance(forced.backend, TritonBackend)
    assert forced.backend.interpret == (not torch.cuda.is_available())
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        MultiLoRALinear(nn.Linear(IN, OUT), 2, 4, backend="cuda")


def test_bad_adapters_and_batches_are_rejected_with_context():
    layer, _ = make_layer("torch")
    with pytest.raises(ValueError, match="rank 16, above this layer's max_rank 8"):
        layer.set_adapter(0, torch.zeros(IN, 16), torch.zeros(16, OUT), 1.0)
    with pytest.raises(ValueError, match=r"expected A \(48, r\) and B \(r, 40\)"):
        layer.set_adapter(0, torch.zeros(IN, 4), torch.zeros(5, OUT), 1.0)
    with pytest.raises(IndexError, match="slot 3 out of range for 3 slots"):
        layer.clear_adapter(3)
    with pytest.raises(ValueError, match="SegmentMeta has 2 slots but this layer has 3"):
        layer(torch.zeros(2, IN), SegmentMeta.from_token_adapter_ids([0, 1], 2))
    with pytest.raises(ValueError, match="4 token rows but the SegmentMeta describes 2"):
        layer(torch.zeros(4, IN), SegmentMeta.from_token_adapter_ids([0, 1], 3))


def test_layer_trains_only_the_adapters_of_tokens_in_the_batch():
    layer, _ = make_layer("torch")
    opt = torch.optim.SGD([layer.lora_a, layer.lora_b], lr=0.1)
    before = layer.lora_a.detach().clone(), layer.lora_b.detach().clone(), layer.base.weight.detach().clone()
    meta = SegmentMeta.from_token_adapter_ids([0, 0, 2, -1], 3)
    layer(torch.randn(4, IN), meta).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(layer.lora_a[0], before[0][0]) and not torch.equal(layer.lora_b[2], before[1][2])
    assert torch.equal(layer.lora_a[1], before[0][1]) and torch.equal(layer.lora_b[1], before[1][1])
    assert torch.equal(layer.base.weight, before[2])

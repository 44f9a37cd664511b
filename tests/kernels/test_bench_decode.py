"""The decode benchmark's model (`benchmarks/bench_decode.py`) computes what it claims: every
row gets its own adapter's LoRA delta in the right module's slice, a mixed batch decodes like
each adapter's rows alone, and the quick CPU run writes every mode. On CUDA (marked `gpu`): the
captured step replays to the eager step's logits, the Triton step matches the torch reference,
and the step does no host sync."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clora.kernels import SegmentMeta, TorchBackend, TritonBackend

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"


def _bench():
    if "bench_decode" not in sys.modules:  # dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_decode"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_decode"]


bd = _bench()
# hidden (48) != heads * head_dim (64), so an input mixed up between projections fails loudly
TINY = bd.Shape(hidden=48, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=256)
SLOTS, CONTEXT = 8, 12
MIXED = torch.tensor([3, 0, 7, 3, 1, 0, 5, 3])  # unsorted, slots 2, 4 and 6 unused
# Which modules' outputs each merged projection holds, in column order (the model's split order).
TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
           "down": ("down_proj",)}


def tiny_model(device="cpu") -> object:
    return bd.DecodeModel(TINY, slots=SLOTS, rank=8, device=device, dtype=torch.float32, seed=1)


def lora_batch(ids: torch.Tensor, backend, device="cpu"):
    return bd.LoRABatch(SegmentMeta.from_token_adapter_ids(ids, SLOTS, device), backend)


def per_row_reference(x, weight, targets, lora, ids):
    """x @ W.T, then each target's slice gets x[t] @ A[a(t)] @ B[a(t)] * scale[a(t)], row by row."""
    y = x @ weight.T
    start = 0
    for name in targets:
        stack = lora[name]
        width = stack.b.shape[2]
        for t, a in enumerate(ids.tolist()):
            y[t, start:start + width] += x[t] @ stack.a[a] @ stack.b[a] * stack.scale[a]
        start += width
    return y


@pytest.mark.parametrize("ids", [MIXED, MIXED.sort().values], ids=["gathered", "sorted"])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_each_merged_projection_adds_every_rows_own_adapter_into_its_modules_slice(ids, backend_name):
    model = tiny_model()
    layer = model.layers[1]
    backend = TorchBackend() if backend_name == "torch" else TritonBackend(interpret=True)  # CPU tensors
    lb = lora_batch(ids, backend)
    gen = torch.Generator().manual_seed(2)
    for merged, weight in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down)):
        x = torch.randn(len(ids), weight.shape[1], generator=gen)
        got = model.project(x, weight, merged, lb.sort(x), layer, lb)
        one_delta = model.project(x, weight, merged, lb.sort(x), layer, replace(lb, merged=True))
        fused = replace(lb, merged=True, fused=True)
        one_launch = model.project(x, weight, merged, fused.sort(x), layer, fused)
        want = per_row_reference(x, weight, TARGETS[merged], layer.lora, ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{merged}: {m}")
        assert not torch.allclose(got, F.linear(x, weight), atol=1e-3), f"{merged}: LoRA added nothing"
        torch.testing.assert_close(one_delta, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{merged}, merged: {m}")
        torch.testing.assert_close(one_launch, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{merged}, fused: {m}")
        overlap = replace(fused, overlap=True)  # no side stream on CPU: the same code, in order
        if merged in ("o", "down"):  # the delta goes into the residual stream the output joins
            residual = torch.randn(len(ids), weight.shape[0], generator=gen)
            kept = residual.clone()
            beside = model.residual_project(residual, x, weight, merged, layer, overlap)
            torch.testing.assert_close(beside, kept + want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{merged}, overlap: {m}")


def test_a_mixed_batch_decodes_like_each_adapters_rows_alone_and_unlike_the_base():
    model = tiny_model()
    pristine = bd.make_state(TINY, len(MIXED), CONTEXT, "cpu", torch.float32, seed=3)
    rope = model.rotary(pristine.position)
    everyone = torch.arange(len(MIXED))
    mixed = pristine.select(everyone)
    logits = model.step(mixed, lora_batch(MIXED, TorchBackend()), rope)  # (batch, vocab)
    base = model.step(pristine.select(everyone), None, rope)
    assert (logits - base).abs().max() > 1e-2, "the adapters changed nothing"
    for slot in MIXED.unique().tolist():
        rows = (MIXED == slot).nonzero().squeeze(1)
        alone = pristine.select(rows)
        got = model.step(alone, lora_batch(torch.full((len(rows),), slot), TorchBackend()), rope)
        torch.testing.assert_close(got, logits[rows], rtol=1e-5, atol=1e-5, msg=lambda m: f"slot {slot}: {m}")
        torch.testing.assert_close(alone.k_cache, mixed.k_cache[:, rows])  # this step's k written alike
        assert torch.equal(alone.tokens, mixed.tokens[rows])


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_the_overlapped_step_decodes_like_the_per_module_step(backend_name):
    """The *_overlap modes' step (o's and down's deltas into the residual stream; in order on
    CPU) gives the per-module step's logits, k/v and tokens."""
    model = tiny_model()
    backend = TorchBackend() if backend_name == "torch" else TritonBackend(interpret=True)
    pristine = bd.make_state(TINY, len(MIXED), CONTEXT, "cpu", torch.float32, seed=4)
    rope = model.rotary(pristine.position)
    everyone = torch.arange(len(MIXED))
    plain, beside = pristine.select(everyone), pristine.select(everyone)
    want = model.step(plain, lora_batch(MIXED, TorchBackend()), rope)
    lb = replace(lora_batch(MIXED, backend), merged=True, fused=True, overlap=True)
    got = model.step(beside, lb, rope)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beside.k_cache, plain.k_cache)
    torch.testing.assert_close(beside.v_cache, plain.v_cache)
    assert torch.equal(beside.tokens, plain.tokens)


def test_the_quick_cpu_run_writes_every_mode_with_ratios_to_base(tmp_path):
    out = tmp_path / "decode.json"
    bd.main(["--device", "cpu", "--quick", "--rounds", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == list(bd.MODES) and {r["batch"] for r in report["rows"]} == {16}
    assert report["graphs"] is False and all(r["graphed_tok_s"] is None for r in rows.values())
    assert all(r["eager_tok_s"] > 0 for r in rows.values())
    assert rows["base"]["eager_vs_base"] == 1.0
    assert [rows[m]["adapters_used"] for m in ("base", "lora1", "lora8", "lora8_sorted")] == [0, 1, 8, 8]
    assert rows["lora8"]["rows_sorted"] is False and rows["lora8_sorted"]["rows_sorted"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for compiled Triton kernels and graphs")
@pytest.mark.parametrize("fused", [False, True, "overlap"], ids=["per-module", "fused", "overlap"])
def test_the_captured_triton_step_replays_the_eager_step_and_matches_the_torch_reference(fused):
    from clora.kernels import make_backend

    model = tiny_model("cuda")
    backend = make_backend("auto", "cuda")
    pristine = bd.make_state(TINY, len(MIXED), CONTEXT, "cuda", torch.float32, seed=3)
    rope = model.rotary(pristine.position)
    everyone = torch.arange(len(MIXED), device="cuda")
    overlap = fused == "overlap"
    lb = replace(lora_batch(MIXED, backend, "cuda"), merged=bool(fused), fused=bool(fused), overlap=overlap,
                 side=torch.cuda.Stream() if overlap else None)
    eager = model.step(pristine.select(everyone), lb, rope)

    cpu_model = tiny_model("cpu")  # same seed on another device draws other weights: copy them
    cpu_model.embed, cpu_model.layers = model.embed.cpu(), [_to_cpu(layer) for layer in model.layers]
    cpu_state = bd.DecodeState(*(t.cpu() for t in (pristine.tokens, pristine.k_cache, pristine.v_cache)))
    reference = cpu_model.step(cpu_state, lora_batch(MIXED, TorchBackend()), tuple(t.cpu() for t in rope))
    torch.testing.assert_close(eager.cpu(), reference, rtol=1e-3, atol=1e-3)  # TF32 may be on

    state = pristine.select(everyone)
    assert bd.check_host_sync(lambda: model.step(state, lb, rope)) == "none"
    graph, out = bd.capture(lambda: model.step(state, lb, rope), torch.device("cuda"))
    for dst, src in zip((state.tokens, state.k_cache, state.v_cache), (pristine.tokens, pristine.k_cache, pristine.v_cache)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


def _to_cpu(layer):
    return bd.Layer(
        **{f: getattr(layer, f).cpu() for f in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")},
        lora={name: bd.LoRAStack(s.a.cpu(), s.b.cpu(), s.scale.cpu()) for name, s in layer.lora.items()},
        merged_lora={name: bd.LoRAStack(s.a.cpu(), s.b.cpu(), s.scale.cpu()) for name, s in layer.merged_lora.items()},
    )

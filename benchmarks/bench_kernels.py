"""Benchmark: segmented multi-LoRA op vs a per-adapter Python loop vs a gathered bmm.

Shapes are SmolLM2-135M's (hidden 576, intermediate 1536, 9 query / 3 kv heads of dim
64, 30 layers): one measurement sums the seven LoRA targets of one decoder layer
(q, k, v, o, gate, up, down); multiply by 30 for the whole model. Each case times the
LoRA delta `y = x @ A[a(t)] @ B[a(t)] * scale[a(t)]` forward, and forward + backward.

Methods (same inputs, same batch):
    loop       PEFT's mixed-batch way: for each adapter, mask its rows, two matmuls
    bmm        gather each token's A and B, then torch.bmm (memory heavy)
    segmented  clora.kernels' segmented op: the torch reference on CPU, Triton on CUDA

Ratios are against `loop` in the same run (this machine is noisy): methods run
round-robin and each keeps its fastest repeat. On CUDA the decode-sized
batches also report the segmented forward's achieved memory bandwidth.

Run:  python benchmarks/bench_kernels.py [--quick] [--out bench-results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from clora.kernels import SegmentMeta, make_backend, segmented_lora

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS, LAYERS = 576, 1536, 64, 9, 3, 30
# The seven LoRA targets of one decoder layer: (name, hidden_in, hidden_out).
TARGETS = [
    ("q_proj", HIDDEN, HEADS * HEAD_DIM),
    ("k_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("v_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("o_proj", HEADS * HEAD_DIM, HIDDEN),
    ("gate_proj", HIDDEN, INTERMEDIATE),
    ("up_proj", HIDDEN, INTERMEDIATE),
    ("down_proj", INTERMEDIATE, HIDDEN),
]
METHODS = ("loop", "bmm", "segmented")


@dataclass(frozen=True)
class Case:
    tokens: int
    adapters: int
    pattern: str  # how tokens spread over adapters: uniform | zipf | identical
    rank: int
    passes: str  # "fwd" | "fwd+bwd"


def token_adapter_ids(pattern: str, tokens: int, adapters: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "uniform":
        return torch.randint(0, adapters, (tokens,), generator=gen)
    if pattern == "zipf":
        p = 1.0 / torch.arange(1, adapters + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(p, tokens, replacement=True, generator=gen)
    if pattern == "identical":
        return torch.zeros(tokens, dtype=torch.int64)
    raise ValueError(f"unknown pattern {pattern!r}")


def loop_lora(x, ids, a, b, scale):
    """Baseline: PEFT-style loop over adapters with boolean row masks (tokens in batch order)."""
    y = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    for i in range(a.shape[0]):
        rows = ids == i
        y = y.index_put((rows,), (x[rows] @ a[i] @ b[i]) * scale[i], accumulate=True)
    return y


def bmm_lora(x, ids, a, b, scale):
    """Baseline: gather each token's adapter, then two batched matmuls."""
    v = torch.bmm(x.unsqueeze(1), a[ids])  # (tokens, 1, rank)
    return torch.bmm(v, b[ids]).squeeze(1) * scale[ids].to(x.dtype).unsqueeze(1)  # (tokens, out)


def measure(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Milliseconds per call for each method: methods run round-robin, so load from other
    processes hits them alike, and each keeps its fastest repeat (the least disturbed)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():  # warm-up (Triton compiles here)
        fn()
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                sync()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                elapsed = (time.perf_counter() - t0) * 1e3
            best[name] = min(best[name], elapsed)
    return best


def lora_bytes(tokens: int, active: int, rank: int, elem: int) -> int:
    """Minimum bytes the segmented forward moves for one layer: x, active A/B, v, y."""
    total = 0
    for _, k, n in TARGETS:
        total += tokens * k + active * (k * rank + rank * n) + 2 * tokens * rank + tokens * n
    return total * elem


def run_case(case: Case, device: torch.device, dtype: torch.dtype, backend, repeats: int, gen) -> dict:
    ids = token_adapter_ids(case.pattern, case.tokens, case.adapters, gen)
    meta = SegmentMeta.from_token_adapter_ids(ids, case.adapters, device=device)
    ids = ids.to(device)
    scale = torch.full((case.adapters,), 2.0, device=device)
    layers = []
    for _, k, n in TARGETS:
        x = torch.randn(case.tokens, k, generator=gen).to(device, dtype)
        a = (torch.randn(case.adapters, k, case.rank, generator=gen) / k**0.5).to(device, dtype)
        b = torch.randn(case.adapters, case.rank, n, generator=gen).to(device, dtype)
        layers.append((x, meta.to_sorted(x), a, b))
    grad = case.passes == "fwd+bwd"
    for x, xs, a, b in layers:
        for t in (x, xs, a, b):
            t.requires_grad_(grad)

    def method(name):
        def one_layer():
            for x, xs, a, b in layers:
                if name == "loop":
                    y = loop_lora(x, ids, a, b, scale)
                elif name == "bmm":
                    y = bmm_lora(x, ids, a, b, scale)
                else:
                    y = segmented_lora(xs, a, b, scale, meta, backend)
                if grad:
                    y.backward(torch.ones_like(y))

        return one_layer

    with torch.set_grad_enabled(grad):
        ms = measure({name: method(name) for name in METHODS}, device, repeats)
    row = {**asdict(case), **{f"{m}_ms": round(v, 4) for m, v in ms.items()}}
    row.update({f"{m}_vs_loop": round(ms["loop"] / ms[m], 2) for m in ("bmm", "segmented")})  # speed-up
    row["segmented_model_ms"] = round(ms["segmented"] * LAYERS, 2)
    if device.type == "cuda" and case.passes == "fwd" and case.tokens <= 64:
        active = int(ids.unique().numel())
        row["segmented_GBps"] = round(lora_bytes(case.tokens, active, case.rank, x.element_size()) / ms["segmented"] / 1e6, 1)
    return row


def cases(quick: bool) -> list[Case]:
    if quick:
        token_counts, adapter_counts, patterns, ranks = (16, 256), (1, 4, 8), ("uniform", "zipf"), (16,)
    else:
        token_counts, adapter_counts, patterns, ranks = (1, 16, 64, 256, 2048), (1, 2, 4, 8), ("uniform", "zipf", "identical"), (8, 16)
    out = []
    for rank in ranks:
        for tokens in token_counts:
            for adapters in adapter_counts:
                for pattern in patterns if adapters > 1 else ("identical",):
                    out.append(Case(tokens, adapters, pattern, rank, "fwd"))
                    if tokens >= 256:
                        out.append(Case(tokens, adapters, pattern, rank, "fwd+bwd"))
    return out


def print_table(rows: list[dict]) -> None:
    cols = ["tokens", "adapters", "pattern", "rank", "passes", "loop_ms", "bmm_ms", "segmented_ms",
            "bmm_vs_loop", "segmented_vs_loop"]
    if any("segmented_GBps" in r for r in rows):
        cols.append("segmented_GBps")
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(widths[c]) for c in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few cases, fewer repeats")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kernels.json"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: OpenMP teams degrade badly on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backend = make_backend("auto", device)
    repeats = 5 if args.quick else 20
    gen = torch.Generator().manual_seed(0)
    print(f"device={device} dtype={dtype} backend={backend!r} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}; times are ms for one decoder layer's 7 LoRA targets, "
          f"'x_vs_loop' = loop time / x time (higher is faster)")
    rows = [run_case(c, device, dtype, backend, repeats, gen) for c in cases(args.quick)]
    print_table(rows)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": "SmolLM2-135M",
        "targets": TARGETS,
        "layers": LAYERS,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype),
        "backend": repr(backend),
        "quick": args.quick,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

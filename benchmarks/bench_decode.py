"""Benchmark: decode tokens/s with 1 and 8 mixed LoRA adapters against the base model alone.

What: one decode step of a SmolLM2-135M-shaped model (hidden 576, 30 layers, 9 query / 3 kv
heads of dim 64, SiLU MLP of 1536, tied 49152-token LM head; random seeded weights, bf16 on
CUDA): one new token for each of `batch` sequences, each attending over a static KV cache of
--context tokens, then greedy argmax into the next step's tokens. Written in plain torch, like
vLLM's Llama: q/k/v and gate/up are merged projections, attention is
`scaled_dot_product_attention`, norms are `F.rms_norm`. Every one of the seven linear modules
(q, k, v, o, gate, up, down) of every layer gets a rank-8 LoRA delta through clora.kernels'
segmented ops (`lora_shrink` then `lora_expand`: Triton on CUDA, the torch reference on CPU),
added into its slice of the merged output.

Modes (same weights, batch and cache; 8 adapter slots resident in every LoRA mode):
    base          no LoRA: the baseline every ratio divides by
    lora1         every row uses slot 0
    lora8         rows round-robin over the 8 slots (row j -> j % 8): each LoRA input is gathered
                  into adapter order (`SegmentMeta.to_sorted`) and the delta scattered back
                  (`index_add_` by `token_order`)
    lora8_sorted  the same mix with the batch kept in adapter order (as a scheduler could place
                  sequences): no gathers
    lora8_zipf    rows drawn Zipf(1.5)-skewed over the 8 slots, in random order
    *_merged      the same rows, with one shrink and one expand per merged projection instead of
                  one per target module: the slices' A side by side (slots, in, slices * rank)
                  and their B block-diagonal (slots, slices * rank, out), scale folded into B, as
                  vLLM stacks a merged layer's LoRA slices. 8 segmented products a layer, not 14
    *_fused       the merged layout through `clora.kernels`' fused kernel (`fused_lora`): shrink and
                  expand in one launch per merged projection, rows read and written through the
                  batch's order in the kernel (no gather, no scatter, nothing to zero): 4 launches
                  a layer
    *_overlap     the fused layout with o's and down's deltas off the step's critical path: each
                  runs on a side stream while the base projection's GEMM runs on the main one
                  (both read the same input) and adds straight into the residual stream, which
                  the GEMM's output joins next anyway. qkv and gate_up stay as in *_fused (their
                  outputs feed rotary and SiLU, so a side delta would cost a zeroed buffer and an
                  add: measured slower). On CPU the same code runs without streams

Why: vLLM serves decode as CUDA-graph replays, so that is what the LoRA overhead must be set
against; eagerly, Python launch overhead dominates a 135M model and the ratio says little.
Both are reported. Target: 8 mixed adapters >= 0.8x base (graphed): lora8, lora8_fused, lora8_fused_overlap.

Graph capture: every mode's whole step (embedding to argmax) is captured once per batch size
(`torch.cuda.CUDAGraph`) and replayed. The segment metadata (`SegmentMeta`: `seg_starts`,
`token_order` on the device; `starts`, `max_seg_len` on the host for launch grids) is built
once per mode, outside the captured region, and the graph reads those static tensors. The
call path from the step into the Triton backend (`lora_shrink`, `lora_expand`,
`segmented_mm`, `SegmentMeta.to_sorted`) was read for host work: shape checks on host ints, no
host sync, no host tensors; its only allocations are device ones from the graph's pool
(`torch.zeros` for the shrink output and the unsorted path's delta, one fill kernel each), and
launch grids come from the metadata's host ints, so nothing beyond the metadata had to be
precomputed. (The CPU reference's fp32 path reads `scale` to the host; CPU runs no graphs.)
Rotary cos/sin are computed before the step too. Each mode also runs
one eager step under `torch.cuda.set_sync_debug_mode("error")` before capture (`host_sync` in
the JSON). Triton compiles in the warm-up steps, before capture. A mode whose capture fails is
timed eagerly only and its row says why (`graph_error`).

Simplifications: every sequence sits at the same position (context + 1 cached keys, no mask),
replays rewrite the same cache slot, greedy argmax stands in for sampling, and norms and rotary
are unfused torch ops in both base and LoRA modes (vLLM fuses them, which makes its base step
faster and the relative LoRA cost somewhat larger than measured here).

Timing: modes run round-robin (--rounds), each round times --graph-steps replays with CUDA
events and --eager-steps eager steps (synchronize + perf_counter); medians are kept. Tokens/s
= batch / step time. Ratios are against `base` of the same batch in the same run.

Run:  python benchmarks/bench_decode.py [--batches 16,64,256] [--context 512] [--out bench-results/decode.json]
      python benchmarks/bench_decode.py --device cpu --quick   # 2 layers, batch 16, eager, torch reference
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from clora.kernels import SegmentedBackend, SegmentMeta, lora_expand, lora_shrink, make_backend

MODES = ("base", "lora1", "lora8", "lora8_sorted", "lora8_zipf", "lora1_merged", "lora8_merged", "lora8_sorted_merged",
         "lora1_fused", "lora8_fused", "lora8_zipf_fused", "lora1_fused_overlap", "lora8_fused_overlap",
         "lora8_zipf_fused_overlap")
# Merged base projections (vLLM's QKVParallelLinear / MergedColumnParallelLinear) and the
# LoRA target modules whose outputs are their column slices, in order.
MERGED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class Shape:
    """Model dimensions; the defaults are SmolLM2-135M's."""

    hidden: int = 576
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30
    vocab: int = 49152
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5

    def target_dims(self) -> dict[str, tuple[int, int]]:
        """LoRA target module -> (hidden_in, hidden_out)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class LoRAStack:
    """One target module's resident adapters, stacked by slot (clora.kernels' layout)."""

    a: torch.Tensor  # (slots, hidden_in, rank)
    b: torch.Tensor  # (slots, rank, hidden_out)
    scale: torch.Tensor  # (slots,) fp32, alpha / rank


@dataclass(frozen=True)
class Layer:
    """One decoder layer's frozen weights (merged projections) and its adapters."""

    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, hidden)
    o: torch.Tensor  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)
    lora: dict[str, LoRAStack]  # target module ("q_proj", ...) -> its stacked adapters
    merged_lora: dict[str, LoRAStack]  # merged projection ("qkv", ...) -> its slices' adapters as one


def merge_slices(stacks: list[LoRAStack]) -> LoRAStack:
    """One LoRAStack equal to `stacks` applied to consecutive column slices of one output:
    A side by side on the rank axis, B block-diagonal, each slice's scale folded into its block."""
    slots, rank = stacks[0].a.shape[0], sum(st.a.shape[2] for st in stacks)
    out = sum(st.b.shape[2] for st in stacks)
    b = torch.zeros(slots, rank, out, device=stacks[0].b.device, dtype=stacks[0].b.dtype)
    r0 = c0 = 0
    for st in stacks:
        r, c = st.b.shape[1], st.b.shape[2]
        b[:, r0:r0 + r, c0:c0 + c] = st.b * st.scale.to(st.b.dtype)[:, None, None]
        r0, c0 = r0 + r, c0 + c
    return LoRAStack(a=torch.cat([st.a for st in stacks], dim=2), b=b,
                     scale=torch.ones(slots, device=stacks[0].scale.device))


@dataclass(frozen=True)
class LoRABatch:
    """Which rows use which adapter slot, and the backend that applies the deltas.

    `meta` is built outside the decode step (and outside any captured graph); the step only
    reads its device tensors and host ints.
    """

    meta: SegmentMeta
    backend: SegmentedBackend
    merged: bool = False
    """One delta per merged projection (`Layer.merged_lora`), not one per target module."""
    fused: bool = False
    """The merged deltas through the fused kernel, in batch order (implies `merged`)."""
    overlap: bool = False
    """o's and down's fused deltas beside their base GEMMs, on `side` (implies `fused`; module doc,
    *_overlap)."""
    side: object = None
    """The side stream of `overlap` (a `torch.cuda.Stream`); None runs it in order (CPU)."""

    def sort(self, x: torch.Tensor) -> torch.Tensor:
        """LoRA input rows (tokens, hidden_in) in adapter order; `x` itself when already sorted
        or when the fused kernel reads the batch's own order."""
        return x if self.fused else self.meta.to_sorted(x)

    def add(self, y: torch.Tensor, xs: torch.Tensor, lora: LoRAStack) -> None:
        """y (tokens, hidden_out, batch order; may be a column slice) += each row's LoRA delta.

        Semantics: `y[t] += x[t] @ A[a(t)] @ B[a(t)] * scale[a(t)]`, with `xs` = x sorted.
        """
        v = lora_shrink(xs, lora.a, self.meta, self.backend)  # (tokens, rank), sorted
        if self.meta.is_sorted:
            lora_expand(y, v, lora.b, lora.scale, self.meta, self.backend)  # in place
        else:
            delta = self.backend.segmented_mm(v, lora.b, self.meta, lora.scale)  # (tokens, hidden_out), sorted
            y.index_add_(0, self.meta.token_order, delta)  # sorted row r -> batch row token_order[r]


@dataclass(frozen=True)
class DecodeState:
    """The static inputs a decode step reads and writes (fixed addresses, so graphs can replay)."""

    tokens: torch.Tensor  # (batch,) int64: this step's input tokens; the step writes the next ones
    k_cache: torch.Tensor  # (layers, batch, kv_heads, context + 1, head_dim)
    v_cache: torch.Tensor  # (layers, batch, kv_heads, context + 1, head_dim)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def position(self) -> int:
        """Where the new token's k/v go: after the `context` cached ones."""
        return self.k_cache.shape[3] - 1

    def select(self, rows: torch.Tensor) -> DecodeState:
        """A copy holding only batch rows `rows` (for the mixed-batch invariant)."""
        return DecodeState(self.tokens[rows].clone(), self.k_cache[:, rows].clone(), self.v_cache[:, rows].clone())


def make_state(shape: Shape, batch: int, context: int, device, dtype, seed: int = 0) -> DecodeState:
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = (shape.layers, batch, shape.kv_heads, context + 1, shape.head_dim)
    return DecodeState(
        tokens=torch.randint(0, shape.vocab, (batch,), generator=gen, device=device),
        k_cache=torch.randn(cache, generator=gen, device=device, dtype=dtype),
        v_cache=torch.randn(cache, generator=gen, device=device, dtype=dtype),
    )


class DecodeModel:
    """A SmolLM2-shaped Llama decoder with random weights and `slots` rank-`rank` adapters on
    every linear module; `step` runs one decode step."""

    def __init__(self, shape: Shape, *, slots: int = 8, rank: int = 8, alpha: float = 16.0,
                 device="cpu", dtype=torch.float32, seed: int = 0) -> None:
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*size, std):
            return (torch.randn(size, generator=gen, device=device) * std).to(dtype)

        s, q, kv = shape, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        ones = torch.ones(s.hidden, device=device, dtype=dtype)
        self.embed = randn(s.vocab, s.hidden, std=0.02)  # (vocab, hidden), tied LM head
        self.final_norm = ones
        scale = torch.full((slots,), alpha / rank, device=device)
        self.layers = []
        for _ in range(s.layers):
            qkv, o = randn(q + 2 * kv, s.hidden, std=0.02), randn(s.hidden, q, std=0.02)
            gate_up, down = randn(2 * s.intermediate, s.hidden, std=0.02), randn(s.hidden, s.intermediate, std=0.02)
            lora = {name: LoRAStack(a=randn(slots, k, rank, std=k**-0.5), b=randn(slots, rank, n, std=0.02), scale=scale)
                    for name, (k, n) in s.target_dims().items()}
            self.layers.append(Layer(
                input_norm=ones, qkv=qkv, o=o, post_norm=ones, gate_up=gate_up, down=down, lora=lora,
                merged_lora={m: merge_slices([lora[t] for t in targets]) for m, targets in MERGED.items()},
            ))
        inv_freq = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
        self._inv_freq = inv_freq  # (head_dim / 2,)

    def rotary(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (head_dim,) for one position (every sequence sits at the same one here)."""
        angles = position * self._inv_freq
        angles = torch.cat([angles, angles])
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def project(self, x: torch.Tensor, weight: torch.Tensor, merged: str, xs: torch.Tensor | None,
                layer: Layer, lb: LoRABatch | None) -> torch.Tensor:
        """Merged base projection `x @ W.T` (tokens, out) plus each target's LoRA delta in its slice.

        `xs` is x in adapter order (`lb.sort(x)`), shared by the targets reading the same x.
        """
        y = F.linear(x, weight)
        if lb is None:
            return y
        if lb.fused:
            stack = layer.merged_lora[merged]
            lb.backend.fused_lora(y, x, stack.a, stack.b, stack.scale, lb.meta)
            return y
        if lb.merged:
            lb.add(y, xs, layer.merged_lora[merged])
            return y
        lora = layer.lora
        start = 0
        for name in MERGED[merged]:
            width = lora[name].b.shape[2]
            lb.add(y[:, start:start + width], xs, lora[name])
            start += width
        return y

    def residual_project(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, merged: str,
                         layer: Layer, lb: LoRABatch | None) -> torch.Tensor:
        """residual + `project(x)`: the next residual stream. With `lb.overlap` the fused delta is
        added into `residual` in place on the side stream while the base GEMM runs."""
        if lb is None or not lb.overlap:
            return residual + self.project(x, weight, merged, lb.sort(x) if lb is not None else None, layer, lb)
        stack = layer.merged_lora[merged]
        _, y = _overlapped(lb.side, lambda: lb.backend.fused_lora(residual, x, stack.a, stack.b, stack.scale, lb.meta),
                           lambda: F.linear(x, weight))
        return residual + y

    def step(self, state: DecodeState, lb: LoRABatch | None, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One decode step: logits (batch, vocab); writes k/v at `state.position` and the argmax
        into `state.tokens`. Makes no host tensors and no host syncs (graph-capturable)."""
        s, b, pos = self.shape, state.batch, state.position
        cos, sin = rope
        group = s.heads // s.kv_heads
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        x = self.embed[state.tokens]  # (batch, hidden)
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), layer.input_norm, s.rms_eps)
            hs = lb.sort(h) if lb is not None else None
            qkv = self.project(h, layer.qkv, "qkv", hs, layer, lb)  # (batch, q + 2 kv)
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
            q = _rope(q.view(b, s.heads, s.head_dim), cos, sin)
            k = _rope(k.view(b, s.kv_heads, s.head_dim), cos, sin)
            state.k_cache[i, :, :, pos].copy_(k)
            state.v_cache[i, :, :, pos].copy_(v.view(b, s.kv_heads, s.head_dim))
            # One new token attends to every cached one, so each kv head's `group` query heads are
            # `group` query rows over that head's cache (no mask): GQA with no repeated k/v.
            attn = F.scaled_dot_product_attention(
                q.view(b, s.kv_heads, group, s.head_dim), state.k_cache[i], state.v_cache[i]
            )  # (batch, kv_heads, group, head_dim)
            attn = attn.reshape(b, q_width)
            x = self.residual_project(x, attn, layer.o, "o", layer, lb)
            h = F.rms_norm(x, (s.hidden,), layer.post_norm, s.rms_eps)
            hs = lb.sort(h) if lb is not None else None
            gate, up = self.project(h, layer.gate_up, "gate_up", hs, layer, lb).split(s.intermediate, dim=-1)
            m = F.silu(gate) * up  # (batch, intermediate)
            x = self.residual_project(x, m, layer.down, "down", layer, lb)
        x = F.rms_norm(x, (s.hidden,), self.final_norm, s.rms_eps)
        logits = F.linear(x, self.embed)  # (batch, vocab)
        state.tokens.copy_(logits.argmax(dim=-1))
        return logits


def _overlapped(side, on_side: Callable[[], object], on_main: Callable[[], torch.Tensor]):
    """(`on_side()`, `on_main()`): the first queued on `side`, the second on the current stream,
    both after everything the current stream has queued and running at once on the GPU; the
    current stream then waits for `side` (a fork and a join, also inside a graph capture).
    `side` None: one after the other. What `on_side` allocates is only reused on `side` after a
    later fork, which waits for the current stream's uses of it, so no `record_stream`."""
    if side is None:
        return on_side(), on_main()
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        got = on_side()
    y = on_main()
    main.wait_stream(side)
    return got, y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF Llama's rotate-half form; x (batch, heads, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def adapter_ids(mode: str, batch: int, slots: int, gen: torch.Generator) -> torch.Tensor | None:
    """Per-row adapter slot for `mode` (None for base)."""
    mode = mode.removesuffix("_overlap").removesuffix("_merged").removesuffix("_fused")
    if mode == "base":
        return None
    if mode == "lora1":
        return torch.zeros(batch, dtype=torch.int64)
    if mode == "lora8":
        return torch.arange(batch) % slots
    if mode == "lora8_sorted":
        return (torch.arange(batch) % slots).sort().values
    if mode == "lora8_zipf":
        p = 1.0 / torch.arange(1, slots + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(p, batch, replacement=True, generator=gen)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def check_host_sync(step: Callable[[], torch.Tensor]) -> str:
    """Run one eager CUDA step with synchronizing ops turned into errors: 'none' or the error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as e:
        return f"host sync: {e}".splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `step` after warm-up steps on a side stream (PyTorch's recipe): the graph and
    the step's output tensor, which each replay rewrites."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize(device)
    return graph, out


def time_graph(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    """Milliseconds per replay, CUDA events around `steps` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def time_eager(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Milliseconds per eager step (host clock; synchronized before and after on CUDA)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


@dataclass
class ModeRun:
    """One (batch, mode) case while it is measured."""

    mode: str
    step: Callable[[], object]
    lb: LoRABatch | None
    graph: torch.cuda.CUDAGraph | None = None
    graph_error: str | None = None
    host_sync: str | None = None
    graph_ms: list[float] | None = None
    eager_ms: list[float] | None = None


def run_batch(model: DecodeModel, backend: SegmentedBackend, batch: int, args, gen: torch.Generator) -> list[dict]:
    device = model.device
    state = make_state(model.shape, batch, args.context, device, model.dtype, seed=args.seed + batch)
    rope = model.rotary(state.position)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None  # the *_overlap modes' side stream
    runs = []
    for mode in MODES:
        ids = adapter_ids(mode, batch, args.adapters, gen)
        # Built here, outside any captured region: the step reads these static tensors.
        overlap = mode.endswith("_overlap")
        lb = None if ids is None else LoRABatch(SegmentMeta.from_token_adapter_ids(ids, args.adapters, device), backend,
                                                merged=mode.endswith(("_merged", "_fused", "_overlap")),
                                                fused=mode.endswith(("_fused", "_overlap")), overlap=overlap,
                                                side=side if overlap else None)
        runs.append(ModeRun(mode, lambda lb=lb: model.step(state, lb, rope), lb, graph_ms=[], eager_ms=[]))
    with torch.inference_mode():
        for run in runs:
            run.step()  # warm-up: Triton compiles, cuBLAS picks algorithms
            if device.type == "cuda":
                run.host_sync = check_host_sync(run.step)
                if args.graphs:
                    try:
                        run.graph, _ = capture(run.step, device)
                    except RuntimeError as e:
                        run.graph_error = str(e).splitlines()[0][:300]
                        torch.cuda.synchronize(device)
        for _ in range(args.rounds):
            for run in runs:
                if run.graph is not None:
                    run.graph_ms.append(time_graph(run.graph, args.graph_steps))
                run.eager_ms.append(time_eager(run.step, args.eager_steps, device))
    rows = []
    for run in runs:
        graph_ms = statistics.median(run.graph_ms) if run.graph_ms else None
        eager_ms = statistics.median(run.eager_ms)
        meta = run.lb.meta if run.lb is not None else None
        rows.append({
            "batch": batch, "mode": run.mode,
            "adapters_used": 0 if meta is None else sum(1 for i in range(meta.num_adapters) if meta.starts[i + 1] > meta.starts[i]),
            "rows_sorted": None if meta is None else meta.is_sorted,
            "graphed_ms": None if graph_ms is None else round(graph_ms, 4),
            "eager_ms": round(eager_ms, 4),
            "graphed_tok_s": None if graph_ms is None else round(batch / graph_ms * 1e3, 1),
            "eager_tok_s": round(batch / eager_ms * 1e3, 1),
            "host_sync": run.host_sync, "graph_error": run.graph_error,
        })
    base = rows[MODES.index("base")]
    for row in rows:
        row["graphed_vs_base"] = (round(row["graphed_tok_s"] / base["graphed_tok_s"], 3)
                                  if row["graphed_tok_s"] and base["graphed_tok_s"] else None)
        row["eager_vs_base"] = round(row["eager_tok_s"] / base["eager_tok_s"], 3)
    return rows  # this batch's graphs, their pools and the cache go with `runs` and `state`


def print_table(rows: list[dict]) -> None:
    cols = ["batch", "mode", "graphed_tok_s", "eager_tok_s", "graphed_vs_base", "eager_vs_base", "graphed_ms", "eager_ms"]
    show = [{c: ("-" if r[c] is None else r[c]) for c in cols} for r in rows]
    widths = {c: max(len(c), *(len(str(r[c])) for r in show)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in show:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in cols))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="2 layers, batch 16, context 32, 2 rounds (a smoke run)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 16,64,256; quick: 16)")
    p.add_argument("--context", type=int, default=None, help="cached tokens per sequence (default 512; quick: 32)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; quick: 2)")
    p.add_argument("--adapters", type=int, default=8, help="adapter slots resident")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=None, help="round-robin repeats (default 7; quick: 2)")
    p.add_argument("--graph-steps", type=int, default=20, help="replays per timed graph repeat")
    p.add_argument("--eager-steps", type=int, default=None, help="steps per timed eager repeat (default 3; quick: 2)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="eager only, also on CUDA")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: OpenMP teams degrade badly on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results/decode.json"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in (args.batches or ("16" if args.quick else "16,64,256")).split(",")]
    args.context = args.context or (32 if args.quick else 512)
    args.layers = args.layers or (2 if args.quick else 30)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.eager_steps = args.eager_steps or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside the test process


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.graphs = args.graphs and device.type == "cuda"
    backend = make_backend("auto", device)
    shape = replace(Shape(), layers=args.layers)
    model = DecodeModel(shape, slots=args.adapters, rank=args.rank, device=device, dtype=dtype, seed=args.seed)
    versions = f"torch={torch.__version__}"
    if device.type == "cuda":
        import triton

        versions += f" triton={triton.__version__} gpu={torch.cuda.get_device_name(device)}"
    print(f"device={device} dtype={dtype} backend={backend!r} {versions}; {shape.layers} layers, context "
          f"{args.context}, {args.adapters} slots of rank {args.rank} on q,k,v,o,gate,up,down; "
          f"graphs={'on' if args.graphs else 'off (eager only)'}; ratios = tokens/s over base's")
    report = {
        "model": "SmolLM2-135M shape, random weights",
        "shape": asdict(shape),
        "context": args.context,
        "adapters": args.adapters,
        "rank": args.rank,
        "targets": list(shape.target_dims()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype),
        "backend": repr(backend),
        "graphs": args.graphs,
        "versions": versions,
        "quick": args.quick,
        "rounds": args.rounds,
        "graph_steps": args.graph_steps,
        "eager_steps": args.eager_steps,
        "modes": list(MODES),
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    for batch in args.batches:
        t0 = time.perf_counter()
        report["rows"] += run_batch(model, backend, batch, args, gen)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(report, indent=2))  # after each batch: a time limit keeps what ran
        print(f"batch {batch}: measured in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = report["rows"]
    print_table(rows)
    for row in rows:
        if row["graph_error"]:
            print(f"batch {row['batch']} {row['mode']}: graph capture failed, timed eagerly only: {row['graph_error']}")
        if row["host_sync"] not in (None, "none"):
            print(f"batch {row['batch']} {row['mode']}: the step synchronizes with the host: {row['host_sync']}")
    key = "graphed_vs_base" if args.graphs else "eager_vs_base"
    for mode in ("lora8", "lora8_fused", "lora8_fused_overlap"):
        print(f"target {mode} >= 0.8x base ({key}): " + ", ".join(
            f"batch {r['batch']}: {'-' if r[key] is None else r[key]}" for r in rows if r["mode"] == mode))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()

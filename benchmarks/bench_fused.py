"""Fused multi-tenant training vs serial steps with swaps: training tokens/s and where time goes.

For K = 2, 4, 8 tenants and per-tenant micro-batches of 1, 2 and 8 sequences, in one run:
    serial  K solo `Trainer.train_step`s per round, round-robin, prefetching the next tenant
            (the adapter store's swap path: one tenant resident at a time)
    fused   one `FusedTrainer.train_step` per round: K tenants resident, their sequences cut
            into length buckets (chunks of at most --max-chunk-tokens), one forward and one
            backward per chunk through the segmented multi-LoRA layers (torch reference on
            CPU, Triton on CUDA)
Both train every tenant on the same SFT examples; a warm-up round (first loads, allocator)
is not timed. Tokens are input tokens (prompt + completion, no padding). Breakdown per mode,
seconds over the timed rounds:
    fwd    forwards incl. log-softmax (fused: and the per-sequence loss)
    bwd    backward passes
    opt    AdamW steps
    swap   serial: time `activate` blocked (not hidden by prefetch); fused: loading / evicting slots
    prep   encoding examples into token batches (fused: and bucketing, packing chunks)
    other  the rest of the wall time (Python step overhead, serial loss, bookkeeping)
Fused rows also give chunks per step and the padding its forwards carried.
--spread s draws each example's length from words * [1 - s, 1 + s] (default 0: every
sequence has the same length, so no mode pads).

    python benchmarks/bench_fused.py [--model smollm2|tiny|<hf dir>] [--quick] [--rounds 2] [--spread 0.5]

Prints a table and writes bench-results/fused.json, ratios = fused tokens/s / serial tokens/s
measured in the same run; `cpu` = serial CPU seconds / fused CPU seconds (process time, all
threads), steadier than wall time when other processes share the cores (under load, wall
time swings 2-5x with how often the two OpenMP threads get a core; CPU time barely moves).
Not only fusion differs: the fused path runs the LM head on target positions only, the serial
`Trainer` on every position (~10% of a step here, half the tokens being prompt).
Runs on CUDA as is when a GPU is present (random-init weights are not needed: the prepared
SmolLM2 is used; `--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import clora.learner.trainer as trainer_mod
from clora.ingest.schemas import Message, SFTExample
from clora.learner.adapter_store import AdapterStore
from clora.learner.base_model import load_base_model, make_tiny_model, prepare_base_model
from clora.learner.batches import ChatEncoder
from clora.learner.fused import FusedTrainer, TenantWork
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy


def examples(tenant: str, n: int, words: int, spread: float = 0.0) -> list[SFTExample]:
    """n examples of ~4 * words tokens; with `spread`, lengths vary by up to that fraction
    (fixed per tenant and index, so serial and fused see the same data)."""
    g = random.Random(f"{tenant}/{n}/{words}/{spread}")
    out = []
    for i in range(n):
        w = max(1, round(words * (1 + spread * (2 * g.random() - 1))))
        body = " ".join(f"w{j}" for j in range(w))
        out.append(SFTExample(example_id=f"{tenant}-{i}", tenant=tenant, interaction_id=f"i{i}",
                              feedback_event_id=f"f{i}", time=0.0,
                              messages=[Message(role="user", content=f"question {i}: {body}")],
                              target=Message(role="assistant", content=f"answer {i}: {body}")))
    return out


class _Timer:
    """Wraps a callable and sums its wall time (synchronising CUDA so the time is real)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.seconds = fn, device, 0.0

    def __call__(self, *a, **kw):
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.fn(*a, **kw)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PARTS = ("forward_s", "backward_s", "optimizer_s", "swap_s", "prepare_s", "other_s")


def run_serial(lm: LoraModel, tok, device, k: int, mb: int, data, policy, rounds: int) -> dict:
    store = AdapterStore(lm, device=device, prefetch=True)
    enc = ChatEncoder(tok, 512)
    tr = Trainer(lm, enc, store, TrainerConfig(micro_batch_size=mb))
    names = list(data)[:k]
    for i, t in enumerate(names):
        store.register(t, seed=i)
    order = names * (rounds + 1)
    # instance attributes / module globals / a class attribute, all undone below
    fwd, opt = _Timer(tr._logprobs, device), _Timer(trainer_mod.adam_step, device)
    bwd = _Timer(torch.Tensor.backward, device)
    prep = _Timer(enc.sft, device)

    def timed_backward(tensor, *a, **kw):  # a function, so that it binds as a method
        return bwd(tensor, *a, **kw)

    tr._logprobs, trainer_mod.adam_step, torch.Tensor.backward, enc.sft = fwd, opt, timed_backward, prep
    try:
        t0 = c0 = 0.0
        for i, t in enumerate(order):
            if i == k:  # first round is warm-up
                _sync(device)
                t0, c0, store.stats.exposed_s = time.perf_counter(), time.process_time(), 0.0
                for timer in (fwd, opt, bwd, prep):
                    timer.seconds = 0.0
            tr.train_step(t, data[t], policy, prefetch=order[i + 1] if i + 1 < len(order) else None)
        _sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        trainer_mod.adam_step, torch.Tensor.backward = opt.fn, bwd.fn
        store.close()
    out = {"wall_s": wall, "cpu_s": cpu, "forward_s": fwd.seconds, "backward_s": bwd.seconds,
           "optimizer_s": opt.seconds,
           "swap_s": store.stats.exposed_s, "prepare_s": prep.seconds}
    out["other_s"] = wall - sum(out[p] for p in PARTS[:-1])
    return out


def run_fused(lm: LoraModel, tok, device, k: int, mb: int, data, policy, rounds: int,
              max_chunk_tokens: int | None = None, max_padding: float | None = None) -> dict:
    store = AdapterStore(lm, device=device, prefetch=True)
    tr = Trainer(lm, ChatEncoder(tok, 512), store, TrainerConfig(micro_batch_size=mb))
    ft = FusedTrainer(tr, k, max_chunk_tokens=max_chunk_tokens, max_padding=max_padding)
    names = list(data)[:k]
    for i, t in enumerate(names):
        store.register(t, seed=i)
    work = [TenantWork(t, data[t], policy) for t in names]
    ft.train_step(work)  # warm-up: loads the K tenants
    parts = dict.fromkeys(PARTS[:-1], 0.0)
    chunks = real = padded = 0
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        r = ft.train_step(work)
        for key in parts:
            parts[key] += getattr(r, key)
        chunks, real, padded = chunks + r.chunks, real + r.real_tokens, padded + r.padded_tokens
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ft.flush()
    store.close()
    return {"wall_s": wall, "cpu_s": cpu, **parts, "other_s": wall - sum(parts.values()), "backend": ft.backend.name,
            "max_chunk_tokens": ft.max_chunk_tokens, "max_padding": ft.max_padding, "chunks_per_step": chunks / rounds,
            "padding": 1 - real / padded if padded else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a local HF model dir")
    ap.add_argument("--models-dir", default=".clora/models")
    ap.add_argument("--quick", action="store_true", help="micro-batches 1 and 2 only, 1 timed round, short sequences")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (each: every tenant steps once)")
    ap.add_argument("--words", type=int, default=24, help="words per message (sets the sequence length)")
    ap.add_argument("--tenants", default="2,4,8")
    ap.add_argument("--micro-batches", default="1,2,8")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--spread", type=float, default=0.0, help="vary sequence lengths by this fraction (0..1)")
    ap.add_argument("--max-chunk-tokens", type=int, default=None,
                    help="padded tokens per fused forward (default: the FusedTrainer's, by device)")
    ap.add_argument("--max-padding", type=float, default=None,
                    help="padding bucketing may add, share of real tokens (default: the FusedTrainer's, by device)")
    ap.add_argument("--out", default="bench-results/fused.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.words, args.micro_batches = 1, min(args.words, 12), "1,2"
    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model == "tiny":
        model_dir = make_tiny_model(Path(args.models_dir) / "tiny-bench", hidden_size=128, num_layers=4)
    else:
        model_dir = prepare_base_model(args.model, args.models_dir)
    model, tok = load_base_model(model_dir, device=device)
    lm = LoraModel(model, LoraSpec(rank=args.rank, alpha=2 * args.rank))
    policy = TrainingPolicy(learning_rate=1e-4, batch_size=8)
    enc = ChatEncoder(tok, 512)
    warm = {f"w{i}": examples(f"w{i}", 1, args.words) for i in range(2)}
    run_serial(lm, tok, device, 2, 1, warm, policy, 1)  # process-wide warm-up: the first run of each kind
    run_fused(lm, tok, device, 2, 1, warm, policy, 1)  # in a process is far slower than later ones
    rows = []
    for k in (int(x) for x in args.tenants.split(",")):
        for mb in (int(x) for x in args.micro_batches.split(",")):
            data = {f"t{i}": examples(f"t{i}", mb, args.words, args.spread) for i in range(k)}
            tokens = args.rounds * sum(int(enc.sft(list(ex)).attention_mask.sum()) for ex in data.values())
            serial = run_serial(lm, tok, device, k, mb, data, policy, args.rounds)
            fused = run_fused(lm, tok, device, k, mb, data, policy, args.rounds, args.max_chunk_tokens,
                              args.max_padding)
            row = {"tenants": k, "micro_batch": mb, "tokens": tokens, "serial": serial, "fused": fused,
                   "serial_tokens_per_s": tokens / serial["wall_s"], "fused_tokens_per_s": tokens / fused["wall_s"]}
            row["ratio_fused_vs_serial"] = row["fused_tokens_per_s"] / row["serial_tokens_per_s"]
            row["cpu_ratio_fused_vs_serial"] = serial["cpu_s"] / fused["cpu_s"]
            rows.append(row)
            print(_line(row), flush=True)
    print(f"\nmodel {model_dir}  device {device}  threads {args.threads}  LoRA params/tenant {lm.layout.numel:,}")
    print(_header())
    for r in rows:
        print(_line(r))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "device": str(device), "threads": args.threads,
                               "rounds": args.rounds, "words": args.words, "spread": args.spread, "rank": args.rank,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


def _header() -> str:
    cols = "fwd/bwd/opt/swap/prep/other s"
    return (f"{'K':>2} {'mb':>3} {'tokens':>7} {'serial tok/s':>12} {'fused tok/s':>11} {'ratio':>6} {'cpu':>5}  "
            f"{'serial ' + cols:>42}  {'fused ' + cols:>41}  {'chunks':>6} {'pad':>5}")


def _line(r: dict) -> str:
    s, f = r["serial"], r["fused"]
    parts = lambda d: "/".join(f"{d[k]:.2f}" for k in PARTS)  # noqa: E731
    return (f"{r['tenants']:>2} {r['micro_batch']:>3} {r['tokens']:>7} {r['serial_tokens_per_s']:12.1f} "
            f"{r['fused_tokens_per_s']:11.1f} {r['ratio_fused_vs_serial']:6.2f} {r['cpu_ratio_fused_vs_serial']:5.2f}  "
            f"{parts(s):>42}  {parts(f):>41}  "
            f"{f['chunks_per_step']:6.1f} {f['padding']:5.1%}")


if __name__ == "__main__":
    main()

"""Learner benchmark: per-step time, tokens/s and the swap cost exposed to training, with and
without prefetch, for 1, 2, 4 and 8 tenants interleaved round-robin.

    python benchmarks/bench_learner.py [--model smollm2|tiny|<hf dir>] [--steps 8] [--batch 2] [--device cuda]
    python benchmarks/bench_learner.py --backend megatron --tp 2 [--dp 2] [...]

With `--backend megatron` the script runs itself under torchrun as T x D ranks: D data-parallel
replicas of T tensor-parallel ranks (`clora.learner.megatron_tp`); rank 0 measures the default
backend first, as the baseline, then the megatron backend on the same data with the same total
CPU threads (each rank gets threads / (T x D)), and prints both with the ratio of their step times.

Prints a table and writes bench-results/learner.json. Ratios are against the no-prefetch
baseline measured in the same run (this machine is noisy). "exposed swap" is the wall time
`AdapterStore.activate` blocked the trainer, as a share of the step time. On CUDA the host
buffers are pinned and swaps go through a side copy stream; every timed region ends with a
device synchronize, so the times are the device's, not the launch queue's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from clora.ingest.schemas import Message, SFTExample
from clora.learner.adapter_store import AdapterStore
from clora.learner.base_model import load_base_model, make_tiny_model, prepare_base_model
from clora.learner.batches import ChatEncoder
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy


def examples(tenant: str, n: int, words: int) -> list[SFTExample]:
    body = " ".join(f"w{i}" for i in range(words))
    return [SFTExample(example_id=f"{tenant}-{i}", tenant=tenant, interaction_id=f"i{i}", feedback_event_id=f"f{i}",
                       time=0.0, messages=[Message(role="user", content=f"question {i}: {body}")],
                       target=Message(role="assistant", content=f"answer {i}: {body}")) for i in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model_dir: Path, *, prefetch: bool, tenants: int, steps: int, batch: int, words: int, rank: int,
        device: torch.device, megatron=None, dtype: torch.dtype = torch.float32) -> dict:
    """One measurement on a fresh default-backend model, or on `megatron` (a MegatronLoraModel,
    reused: its other ranks follow it)."""
    if megatron is None:
        model, tok = load_base_model(model_dir, device=device, dtype=dtype)
        lm = LoraModel(model, LoraSpec(rank=rank, alpha=2 * rank))
    else:
        from transformers import AutoTokenizer

        lm, tok = megatron, AutoTokenizer.from_pretrained(str(model_dir))
    store = AdapterStore(lm, device=device, prefetch=prefetch, compute_dtype=dtype)
    tr = Trainer(lm, ChatEncoder(tok, 512), store, TrainerConfig(micro_batch_size=batch))
    names = [f"t{i}" for i in range(tenants)]
    for i, t in enumerate(names):
        store.register(t, seed=i)
    data = {t: examples(t, batch, words) for t in names}
    policy = TrainingPolicy(learning_rate=1e-4, batch_size=batch)
    tr.train_step(names[0], data[names[0]], policy)  # warm-up (allocator, first-call overheads)
    _sync(device)
    store.stats.exposed_s, store.stats.swaps = 0.0, 0
    order = [names[i % tenants] for i in range(1, steps + 1)]
    tokens, t0, times = 0, time.perf_counter(), []
    for i, t in enumerate(order):
        nxt = order[i + 1] if i + 1 < len(order) else None
        r = tr.train_step(t, data[t], policy, prefetch=nxt)
        tokens, times = tokens + r.tokens, times + [r.seconds]
    _sync(device)
    wall = time.perf_counter() - t0
    store.close()
    return {"backend": "default" if megatron is None else f"megatron T={megatron.tp} D={megatron.dp}",
            "prefetch": prefetch, "tenants": tenants, "steps": steps, "step_s": wall / steps,
            "median_step_s": statistics.median(times),
            "tokens_per_s": tokens / wall, "swaps": store.stats.swaps, "exposed_swap_s": store.stats.exposed_s,
            "exposed_share": store.stats.exposed_s / wall,
            "bytes_per_tenant": store.bytes_per_tenant, "lora_params": lm.layout.numel}


def raw_swap_s(model_dir: Path, rank: int, device: torch.device, repeats: int = 21) -> float:
    """Median cost of one synchronous swap (write one tenant back, load another), nothing to hide it."""
    lm = LoraModel(load_base_model(model_dir, device=device)[0], LoraSpec(rank=rank, alpha=2 * rank))
    store = AdapterStore(lm, device=device, prefetch=False)
    store.register("a", 0), store.register("b", 1)
    store.activate("a")
    _sync(device)
    times = []
    for k in range(repeats):
        s0 = time.perf_counter()
        store.activate("b" if k % 2 == 0 else "a")
        _sync(device)
        times.append(time.perf_counter() - s0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a local HF model dir")
    ap.add_argument("--models-dir", default=".clora/models")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--words", type=int, default=12, help="words per message (sets sequence length)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (split over the ranks)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--backend", default="default", choices=["default", "megatron"])
    ap.add_argument("--tp", type=int, default=2, help="megatron: tensor parallel size (processes)")
    ap.add_argument("--dp", type=int, default=1, help="megatron: data parallel size (replicas of the T ranks)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="megatron: compute dtype")
    ap.add_argument("--out", default=None, help="default: bench-results/learner.json (learner-megatron.json)")
    args = ap.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.model == "tiny":
        model_dir = make_tiny_model(Path(args.models_dir) / "tiny-bench", hidden_size=128, num_layers=4)
    else:
        model_dir = prepare_base_model(args.model, args.models_dir)
    if args.backend == "megatron":
        megatron_main(args, model_dir, device)
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out or "bench-results/learner.json")
    raw_swap = raw_swap_s(model_dir, args.rank, device)
    run(model_dir, prefetch=True, tenants=2, steps=2, batch=args.batch, words=args.words, rank=args.rank,
        device=device)  # warm-up
    rows = []
    for n in (int(x) for x in args.tenants.split(",")):
        for prefetch in (False, True):
            rows.append(run(model_dir, prefetch=prefetch, tenants=n, steps=max(args.steps, n), batch=args.batch,
                            words=args.words, rank=args.rank, device=device))
    base = {r["tenants"]: r for r in rows if not r["prefetch"]}
    single = base[min(base)]["tokens_per_s"]
    for r in rows:
        b = base[r["tenants"]]
        r["step_ratio_vs_no_prefetch"] = r["step_s"] / b["step_s"]
        r["exposed_ratio_vs_no_prefetch"] = (r["exposed_swap_s"] / b["exposed_swap_s"]) if b["exposed_swap_s"] else None
        r["tokens_per_s_ratio_vs_1_tenant"] = r["tokens_per_s"] / single
    print(f"model {model_dir}  device {device}  LoRA params {rows[0]['lora_params']:,}  bytes/tenant {rows[0]['bytes_per_tenant']:,}")
    print(f"synchronous swap (out + in), median: {1e3 * raw_swap:.2f} ms")
    hdr = f"{'N':>2} {'prefetch':>8} {'step s':>8} {'median s':>8} {'tok/s':>8} {'x1-ten':>7} {'exposed ms/swap':>15} {'share':>7} {'vs base':>8}"
    print(hdr)
    for r in rows:
        er = r["exposed_ratio_vs_no_prefetch"]
        print(f"{r['tenants']:>2} {str(r['prefetch']):>8} {r['step_s']:8.3f} {r['median_step_s']:8.3f} {r['tokens_per_s']:8.1f} "
              f"{r['tokens_per_s_ratio_vs_1_tenant']:7.2f} {1e3 * r['exposed_swap_s'] / max(r['swaps'], 1):15.2f} "
              f"{100 * r['exposed_share']:6.2f}% {'' if er is None else f'{er:8.2f}':>8}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "threads": args.threads, "device": str(device), "raw_swap_s": raw_swap,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


def dist_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "none"


def megatron_main(args, model_dir: Path, device: torch.device) -> None:
    """Under torchrun: every rank builds its shard; rank 0 measures the default backend (the
    baseline, with all the threads while the other ranks wait) and then the megatron backend."""
    import os
    import sys

    ranks = args.tp * args.dp
    if "LOCAL_RANK" not in os.environ:   # become torchrun over T x D copies of this script
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={ranks}", __file__, *sys.argv[1:]])
    from clora.learner import megatron_tp

    megatron_tp.init_parallel(args.tp, args.dp)
    torch.set_num_threads(max(1, args.threads // ranks))
    dtype = getattr(torch, args.dtype)
    lm = megatron_tp.MegatronLoraModel(model_dir, LoraSpec(rank=args.rank, alpha=2 * args.rank), dtype=dtype)
    if lm.rank != 0:
        lm.follow()
        return
    try:
        common = dict(prefetch=True, batch=args.batch, words=args.words, rank=args.rank, device=device, dtype=dtype)
        tenants = [int(x) for x in args.tenants.split(",")]
        run(model_dir, tenants=2, steps=2, megatron=lm, **common)  # warm-up
        rows = []
        for n in tenants:
            torch.set_num_threads(args.threads)
            run(model_dir, tenants=2, steps=2, **common)  # warm-up
            rows.append(run(model_dir, tenants=n, steps=max(args.steps, n), **common))
            torch.set_num_threads(max(1, args.threads // ranks))
            rows.append(run(model_dir, tenants=n, steps=max(args.steps, n), megatron=lm, **common))
    finally:
        lm.stop_followers()
    base = {r["tenants"]: r for r in rows if r["backend"] == "default"}
    for r in rows:
        r["step_ratio_vs_default"] = r["step_s"] / base[r["tenants"]]["step_s"]
    print(f"model {model_dir}  device {device}  threads {args.threads} in all  LoRA params {rows[0]['lora_params']:,}")
    print(f"{'N':>2} {'backend':>18} {'step s':>8} {'median s':>8} {'tok/s':>8} {'vs default':>10}")
    for r in rows:
        print(f"{r['tenants']:>2} {r['backend']:>18} {r['step_s']:8.3f} {r['median_step_s']:8.3f} "
              f"{r['tokens_per_s']:8.1f} {r['step_ratio_vs_default']:10.2f}")
    out = Path(args.out or "bench-results/learner-megatron.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "threads": args.threads, "tp": args.tp, "dp": args.dp,
                               "device": str(device),
                               "dtype": args.dtype, "backend": dist_backend(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""CPU multi-LoRA decode: vLLM's own CPU LoRA ops vs clora's replacements, on one engine.

One in-process vLLM engine (SmolLM2-135M, fp32, LoRA on) generates the same greedy batch with
each implementation of the LoRA path swapped in between runs (vLLM looks its ops and the
wrapper's methods up at call time, so one engine serves every variant):

  vllm     vLLM 0.32's torch ops (`PunicaWrapperCPU` unchanged; base rows in a mixed batch get
           the last slot's adapter, so its mixed-batch outputs differ)
  grouped  clora's grouped ops only (`bgmv_*` / `sgmv_*` replaced, the wrapper unchanged)
  clora    what serving runs: the grouped ops plus one plan per forward step
           (`add_lora_linear`, `add_lora_logits`)

for 0 (base rows only), 1 and 8 adapters. It prints tokens/s (median of `--repeats`) and the
ratio to base, checks that `grouped` and `clora` generate the same tokens, and writes JSON.

    .venv/bin/python benchmarks/bench_cpu_lora.py [--prompts 16 --max-tokens 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: patchable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

VARIANTS = ("vllm", "grouped", "clora")


def _use(variant: str, originals: dict) -> None:
    """Swap the LoRA path of the running engine to `variant`."""
    import vllm.lora.punica_wrapper.punica_cpu as pc

    from clora.serving import vllm_cpu_lora as ours

    for op in ours.OPS:
        setattr(pc, op, originals[op] if variant == "vllm" else getattr(ours, op))
    for method in ours.PLAN_METHODS:
        impl = getattr(ours, method) if variant == "clora" else originals[method]
        setattr(pc.PunicaWrapperCPU, method, impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-lora-rank", type=int, default=16, help="the engine's (serving's default: 16)")
    ap.add_argument("--rank", type=int, default=8, help="the adapters' (the learner's default: 8)")
    ap.add_argument("--out", default="bench-results/cpu_lora.json")
    ap.add_argument("--model-cache", default=str(Path.home() / ".cache" / "clora" / "models"))
    args = ap.parse_args()

    import vllm.lora.punica_wrapper.punica_cpu as pc
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from clora.learner.base_model import prepare_base_model
    from clora.serving import vllm_cpu_lora as ours

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_serving import build_adapters

    originals = {op: getattr(pc, op) for op in ours.OPS}
    originals.update({m: getattr(pc.PunicaWrapperCPU, m) for m in ours.PLAN_METHODS})
    model = prepare_base_model("smollm2", cache_dir=args.model_cache)
    work = Path(tempfile.mkdtemp(prefix="clora-bench-cpu-lora-"))
    try:
        adapters = [LoRARequest(f"a{i}", i + 1, str(path))
                    for i, path in enumerate(build_adapters(model, work, 8, rank=args.rank))]
        llm = LLM(model=str(model), dtype="float32", enable_lora=True, max_loras=8,
                  max_lora_rank=args.max_lora_rank, max_model_len=1024, enforce_eager=True, seed=0)
        prompts = [f"Question {i}: what is {i} plus {7 * i}? Explain step by step." for i in range(args.prompts)]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

        def run(n_adapters: int):
            lr = [adapters[i % n_adapters] for i in range(len(prompts))] if n_adapters else None
            t0 = time.perf_counter()
            out = llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
            wall = time.perf_counter() - t0
            return sum(len(o.outputs[0].token_ids) for o in out) / wall, [list(o.outputs[0].token_ids) for o in out]

        results, tokens = {}, {}
        for variant in VARIANTS:
            _use(variant, originals)
            for n in (0, 1, 8):
                run(n)  # warm: loads the adapters into their slots
                rates = []
                for _ in range(args.repeats):
                    rate, toks = run(n)
                    rates.append(rate)
                results[f"{variant}/{n}"] = {"tokens_per_s": statistics.median(rates), "runs": rates}
                tokens[(variant, n)] = toks
                print(f"{variant:8s} {n} adapter(s): {statistics.median(rates):7.1f} tok/s", flush=True)
        _use("clora", originals)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    same = {n: tokens[("grouped", n)] == tokens[("clora", n)] for n in (0, 1, 8)}
    print(f"\nSmolLM2-135M fp32, {args.prompts} sequences x {args.max_tokens} tokens, adapters rank {args.rank} "
          f"in max_lora_rank {args.max_lora_rank}, {os.cpu_count()} CPUs")
    print(f"{'LoRA path':10s}" + "".join(f"{h:>22s}" for h in ("base rows", "1 adapter", "8 adapters")))
    rate = lambda variant, n: results[f"{variant}/{n}"]["tokens_per_s"]
    for variant in VARIANTS:
        cells = [f"{rate(variant, n):7.1f} ({rate(variant, n) / rate('vllm', n):4.2f}x)" for n in (0, 1, 8)]
        print(f"{variant:10s}" + "".join(f"{c:>22s}" for c in cells))
    print("tok/s (x vLLM's ops on the same batch); clora's tokens == grouped's:",
          ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in same.items()))
    print("clora's 1 / 8 adapters vs its base rows: "
          f"{rate('clora', 1) / rate('clora', 0):.2f}x / {rate('clora', 8) / rate('clora', 0):.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "config": vars(args) | {"cpus": os.cpu_count()}, "results": results,
        "same_tokens_grouped_vs_clora": {str(n): ok for n, ok in same.items()}}, indent=1))
    print(f"wrote {args.out}")
    if not all(same.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
